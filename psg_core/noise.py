"""Gaussian noise for DP-SGD.

The Gaussian mechanism adds ``N(0, (noise_multiplier * sensitivity)^2)`` independently to every
coordinate of the *sum* of clipped per-sample gradients, once per step (in the service: on the
frontend, after the shard results are merged, never per shard). The sensitivity is the L2 bound on
one sample's clipped contribution, :func:`psg_core.dp.l2_sensitivity` of the step's configuration:
the clipping bound C, or ``sqrt(sum_i C_i^2)`` under per-layer clipping with explicit bounds.
"""

from __future__ import annotations

import math
import os
import secrets
import warnings
from collections.abc import Mapping

import torch

from psg_core.errors import ConfigError

__all__ = ["add_noise", "add_noise_", "check_noise_arguments", "secure_generator", "secure_normal"]


def secure_generator(device: torch.device | str = "cpu") -> torch.Generator:
    """A fresh ``torch.Generator`` on ``device`` seeded with 64 bits from the OS's CSPRNG.

    The seed comes from :mod:`secrets` (``os.urandom``), is never reused and never leaves this
    function, so the noise cannot be predicted by anyone who does not see the generator. The
    stream itself is torch's generator (MT19937 on CPU, Philox on CUDA); brute-forcing the seed
    means searching 2**64 values.

    >>> secure_generator().device
    device(type='cpu')
    """
    generator = torch.Generator(device=device)
    generator.manual_seed(secrets.randbits(64))
    return generator


_MANTISSA = (1 << 53) - 1


def secure_normal(shape: tuple[int, ...], *, std: float, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Gaussian noise drawn *directly* from the OS's CSPRNG (``os.urandom``), on the CPU.

    Box-Muller on 53-bit uniforms: every value depends only on fresh OS randomness, so there is no
    generator state to guess (unlike :func:`secure_generator`, whose stream is torch's PRNG).

    >>> secure_normal((4, 2), std=1.0).shape
    torch.Size([4, 2])
    """
    count = math.prod(shape)
    if count == 0:
        return torch.zeros(shape, dtype=dtype)
    pairs = (count + 1) // 2
    raw = torch.frombuffer(bytearray(os.urandom(16 * pairs)), dtype=torch.int64)  # (2*pairs,)
    uniform = ((raw & _MANTISSA).to(torch.float64) + 1.0) * 2.0 ** -53  # (2*pairs,) in (0, 1]
    radius = torch.sqrt(-2.0 * torch.log(uniform[0::2]))  # (pairs,)
    angle = (2.0 * math.pi) * uniform[1::2]  # (pairs,)
    normal = torch.stack((radius * torch.cos(angle), radius * torch.sin(angle)), 1).reshape(-1)
    return (normal[:count] * std).reshape(shape).to(dtype)


def _check_number(value: object, *, what: str, positive: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value < 0 or (positive and value == 0):
        bound = "> 0" if positive else ">= 0"
        raise ConfigError(f"add_noise: {what} must be a finite number {bound}, got {value!r}")
    return float(value)


def _sensitivity(sensitivity: float | None, max_grad_norm: float | None) -> float:
    """The bound, given under its name or (with a ``DeprecationWarning``) under its old one."""
    if max_grad_norm is None:
        if sensitivity is None:
            raise ConfigError("add_noise: sensitivity is required (the L2 bound on one sample's "
                              "contribution, psg_core.l2_sensitivity(config))")
        return sensitivity
    if sensitivity is not None:
        raise ConfigError("add_noise: pass sensitivity only (max_grad_norm is its deprecated name), not both")
    warnings.warn("add_noise: max_grad_norm is deprecated; pass sensitivity=psg_core.l2_sensitivity(config)",
                  DeprecationWarning, stacklevel=4)  # add_noise -> check_noise_arguments -> here
    return max_grad_norm


def check_noise_arguments(grads: Mapping[str, torch.Tensor], *, noise_multiplier: float,
                          sensitivity: float | None, generator: torch.Generator | None = None,
                          secure_rng: bool = False, max_grad_norm: float | None = None
                          ) -> tuple[float, float]:
    """What :func:`add_noise` checks before drawing: raises :class:`ConfigError` as it would;
    returns ``(sigma, sensitivity)``."""
    sigma = _check_number(noise_multiplier, what="noise_multiplier", positive=False)
    bound = _check_number(_sensitivity(sensitivity, max_grad_norm), positive=True,
                          what="sensitivity" if max_grad_norm is None else "max_grad_norm")
    if generator is not None and secure_rng:
        raise ConfigError("add_noise: pass either a generator or secure_rng=True, not both")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise ConfigError(f"add_noise: generator must be a torch.Generator, got {type(generator).__name__}")
    for name, grad in grads.items():
        if not isinstance(grad, torch.Tensor) or not grad.is_floating_point():
            raise ConfigError(f"add_noise: grads[{name!r}] must be a floating tensor, got "
                              f"{type(grad).__name__} {getattr(grad, 'dtype', '')}")
    return sigma, bound


def add_noise(grads: Mapping[str, torch.Tensor], *, noise_multiplier: float, sensitivity: float | None = None,
              generator: torch.Generator | None = None, secure_rng: bool = False,
              max_grad_norm: float | None = None) -> dict[str, torch.Tensor]:
    """Returns ``grads`` plus Gaussian noise of std ``noise_multiplier * sensitivity``.

    The input tensors are not modified. Noise is drawn parameter by parameter in the mapping's
    order, so the same generator state and the same names give the same noise. It is drawn in
    (at least) fp32 on the generator's device and added before casting back to each tensor's
    dtype; a CPU generator therefore gives the same noise for CPU and CUDA gradients.

    Args:
        grads: ``{name: tensor}``, typically the clipped sum from :func:`psg_core.dp_gradient`.
        noise_multiplier: sigma >= 0; zero returns copies without noise.
        sensitivity: > 0, the L2 bound on one sample's contribution to the sum:
            ``psg_core.l2_sensitivity(config)`` of the config the sum was computed with (the
            clipping bound C, or ``sqrt(sum_i C_i^2)`` for per-layer bounds ``C_i``).
        generator: a seeded ``torch.Generator`` (seed it per step for reproducible runs); None
            uses torch's global generator, unless ``secure_rng``.
        secure_rng: draw every noise value directly from the OS's CSPRNG (see
            :func:`secure_normal`); incompatible with ``generator``.
        max_grad_norm: deprecated name of ``sensitivity`` (it is only the clipping bound under
            flat or automatic clipping); still accepted, with a ``DeprecationWarning``.

    Returns:
        ``{name: noised tensor}`` with the same names, shapes, dtypes and devices.

    >>> g = torch.Generator().manual_seed(0)
    >>> noised = add_noise({"w": torch.zeros(10_000)}, noise_multiplier=2.0, sensitivity=0.5,
    ...                    generator=g)
    >>> round(noised["w"].std().item(), 1)
    1.0
    """
    sigma, bound = check_noise_arguments(grads, noise_multiplier=noise_multiplier, sensitivity=sensitivity,
                                         generator=generator, secure_rng=secure_rng,
                                         max_grad_norm=max_grad_norm)
    if sigma == 0.0:
        return {name: grad.clone() for name, grad in grads.items()}
    out = {}
    for name, grad in grads.items():
        noise = _draw(grad, sigma * bound, generator, secure_rng)  # (*shape)
        if grad.dtype == noise.dtype:
            out[name] = noise.add_(grad)  # the fresh noise tensor holds the sum: no second (*shape) buffer
        else:
            out[name] = (grad.to(noise.dtype) + noise).to(grad.dtype)
    return out


def add_noise_(grads: Mapping[str, torch.Tensor], *, noise_multiplier: float, sensitivity: float,
               generator: torch.Generator | None = None, secure_rng: bool = False) -> dict[str, torch.Tensor]:
    """:func:`add_noise` written into ``grads``' own tensors (returned): the same noise, drawn in
    the same order, and bit for bit the same values, with no second parameter-sized buffer per
    tensor (the noise is added where the sum is, instead of the sum copied onto the noise).

    >>> grads = {"w": torch.zeros(4)}
    >>> add_noise_(grads, noise_multiplier=1.0, sensitivity=1.0, generator=torch.Generator().manual_seed(0))["w"] is grads["w"]
    True
    """
    sigma, bound = check_noise_arguments(grads, noise_multiplier=noise_multiplier, sensitivity=sensitivity,
                                         generator=generator, secure_rng=secure_rng)
    if sigma != 0.0:
        for grad in grads.values():
            noise = _draw(grad, sigma * bound, generator, secure_rng)  # (*shape)
            if grad.dtype == noise.dtype:
                grad.add_(noise)
            else:
                grad.copy_(grad.to(noise.dtype) + noise)
    return dict(grads)


def _draw(grad: torch.Tensor, std: float, generator: torch.Generator | None, secure_rng: bool) -> torch.Tensor:
    """Gaussian noise for ``grad``: in (at least) fp32, drawn on the generator's device (or from the
    OS, ``secure_rng``), then on ``grad``'s device."""
    work_dtype = torch.promote_types(grad.dtype, torch.float32)
    if secure_rng:
        noise = secure_normal(tuple(grad.shape), std=std, dtype=work_dtype)  # (*shape)
    else:
        noise_device = generator.device if generator is not None else grad.device
        noise = torch.normal(0.0, std, size=tuple(grad.shape), generator=generator,
                             dtype=work_dtype, device=noise_device)  # (*shape)
    return noise.to(grad.device)
