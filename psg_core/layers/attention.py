"""Multi-head attention rebuilt from layers that have grad samplers.

``nn.MultiheadAttention`` keeps its input projection in one fused parameter and runs a fused
kernel, so hooks cannot attribute its gradient to samples. :class:`DPMultiheadAttention` computes
the same function with three ``nn.Linear`` projections, an ``nn.Linear`` output projection and
(for ``add_bias_kv``) two :class:`SequenceBias` layers, so every trainable parameter sits in a
layer that has a grad sampler.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from psg_core.errors import ConfigError
from psg_core.provenance import active_tracker

__all__ = ["DPMultiheadAttention", "SequenceBias"]


def _factory(device: Any, dtype: Any) -> dict[str, Any]:
    return {"device": device, "dtype": dtype}


class SequenceBias(nn.Module):
    """Appends one learned step at the end of every sequence: ``(.., T, .., E) -> (.., T+1, .., E)``.

    This is ``add_bias_kv`` of multi-head attention as a layer of its own, so that its parameter
    gets per-sample gradients (:mod:`psg_core.grad_sample.sequence_bias`).

    Args:
        embed_dim: E, the feature size of the sequence and of the bias.
        batch_first: input is ``(B, T, E)`` when True, ``(T, B, E)`` when False; wrap it with a
            :class:`~psg_core.GradSampleModule` of the same ``batch_first``.

    >>> layer = SequenceBias(4, batch_first=True)
    >>> layer(torch.zeros(2, 3, 4)).shape
    torch.Size([2, 4, 4])
    """

    def __init__(self, embed_dim: int, *, batch_first: bool = False, device: Any = None,
                 dtype: Any = None) -> None:
        super().__init__()
        if embed_dim < 1:
            raise ConfigError(f"SequenceBias: embed_dim must be >= 1, got {embed_dim}")
        self.embed_dim = embed_dim
        self.batch_first = batch_first
        self.bias = nn.Parameter(torch.empty(embed_dim, **_factory(device, dtype)))  # (E,)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Normal with std ``1/sqrt(E)``, the distribution torch's ``add_bias_kv`` starts from."""
        nn.init.normal_(self.bias, std=1.0 / math.sqrt(self.embed_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 3 or x.shape[-1] != self.embed_dim:
            raise ConfigError(f"SequenceBias.forward: expected a 3-D input ending in "
                              f"{self.embed_dim} features, got shape {tuple(x.shape)}")
        if self.batch_first:
            step = self.bias.view(1, 1, -1).expand(x.shape[0], 1, -1)  # (B, 1, E)
            return torch.cat([x, step], dim=1)  # (B, T+1, E)
        step = self.bias.view(1, 1, -1).expand(1, x.shape[1], -1)  # (1, B, E)
        return torch.cat([x, step], dim=0)  # (T+1, B, E)

    def extra_repr(self) -> str:
        return f"{self.embed_dim}, batch_first={self.batch_first}"


def _float_mask(mask: torch.Tensor, dtype: torch.dtype, *, name: str) -> torch.Tensor:
    """Bool masks (True = not allowed) become additive ``-inf`` masks, as torch does."""
    if mask.dtype == torch.bool:
        additive = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
        return additive.masked_fill_(mask, float("-inf"))
    if not mask.is_floating_point():
        raise ConfigError(f"DPMultiheadAttention.forward: {name} must be bool or floating point, "
                          f"got {mask.dtype}")
    return mask.to(dtype)


class DPMultiheadAttention(nn.Module):
    """``nn.MultiheadAttention`` with separate ``q_proj``/``k_proj``/``v_proj`` Linear layers.

    Same constructor and ``forward`` as :class:`torch.nn.MultiheadAttention`, same outputs (up to
    floating point rounding) once the weights are loaded: ``load_state_dict`` accepts both this
    module's own state dict and an ``nn.MultiheadAttention`` state dict (``in_proj_weight`` /
    ``in_proj_bias``, or ``q/k/v_proj_weight`` when ``kdim``/``vdim`` differ, and
    ``bias_k``/``bias_v``), which is what :func:`psg_core.fix_model` uses.

    Trainable parameters live in ``q_proj``, ``k_proj``, ``v_proj``, ``out_proj`` (nn.Linear) and,
    with ``add_bias_kv``, ``seq_bias_k``/``seq_bias_v`` (:class:`SequenceBias`). The projections
    run on the caller's layout, so wrap the model with a
    :class:`~psg_core.GradSampleModule` whose ``batch_first`` equals this layer's.

    ``is_causal`` is a hint, as in torch: ``attn_mask`` must be given and is the mask applied
    (torch does the same when it returns weights; without weights, combined with ``add_bias_kv`` or
    ``add_zero_attn``, torch instead masks causally over the extended keys).
    ``in_proj_weight`` and ``in_proj_bias`` are always None (there is no fused projection); torch's
    Transformer layers read them and then keep to their regular, non-fused code path.

    >>> mha = DPMultiheadAttention(8, 2, batch_first=True)
    >>> x = torch.randn(3, 5, 8)
    >>> out, weights = mha(x, x, x)
    >>> out.shape, weights.shape
    (torch.Size([3, 5, 8]), torch.Size([3, 5, 5]))
    """

    in_proj_weight: None = None
    in_proj_bias: None = None

    def __init__(self, embed_dim: int, num_heads: int, dropout: float = 0.0, bias: bool = True,
                 add_bias_kv: bool = False, add_zero_attn: bool = False, kdim: int | None = None,
                 vdim: int | None = None, batch_first: bool = False, device: Any = None,
                 dtype: Any = None) -> None:
        super().__init__()
        if embed_dim < 1 or num_heads < 1 or embed_dim % num_heads:
            raise ConfigError(f"DPMultiheadAttention: embed_dim ({embed_dim}) must be a positive "
                              f"multiple of num_heads ({num_heads})")
        if not 0.0 <= dropout <= 1.0:
            raise ConfigError(f"DPMultiheadAttention: dropout must be in [0, 1], got {dropout}")
        factory = _factory(device, dtype)
        self.embed_dim = embed_dim
        self.kdim = kdim if kdim is not None else embed_dim
        self.vdim = vdim if vdim is not None else embed_dim
        self._qkv_same_embed_dim = self.kdim == embed_dim and self.vdim == embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.dropout = dropout
        self.batch_first = batch_first
        self.add_zero_attn = add_zero_attn
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        self.k_proj = nn.Linear(self.kdim, embed_dim, bias=bias, **factory)
        self.v_proj = nn.Linear(self.vdim, embed_dim, bias=bias, **factory)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        self.seq_bias_k: SequenceBias | None = None
        self.seq_bias_v: SequenceBias | None = None
        if add_bias_kv:
            self.seq_bias_k = SequenceBias(embed_dim, batch_first=batch_first, **factory)
            self.seq_bias_v = SequenceBias(embed_dim, batch_first=batch_first, **factory)
        self._reset_parameters()
        self.register_load_state_dict_pre_hook(_from_torch_state_dict)

    def _reset_parameters(self) -> None:
        # Same distributions as torch: Xavier-uniform over the fused (3E, E) matrix when q, k and v
        # share a size, zero biases.
        if self._qkv_same_embed_dim:
            bound = math.sqrt(6.0 / (4 * self.embed_dim))
            for proj in (self.q_proj, self.k_proj, self.v_proj):
                nn.init.uniform_(proj.weight, -bound, bound)
        else:
            for proj in (self.q_proj, self.k_proj, self.v_proj):
                nn.init.xavier_uniform_(proj.weight)
        for proj in (self.q_proj, self.k_proj, self.v_proj, self.out_proj):
            if proj.bias is not None:
                nn.init.zeros_(proj.bias)

    def extra_repr(self) -> str:
        return (f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, dropout={self.dropout}, "
                f"kdim={self.kdim}, vdim={self.vdim}, add_zero_attn={self.add_zero_attn}, "
                f"batch_first={self.batch_first}")

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                key_padding_mask: torch.Tensor | None = None, need_weights: bool = True,
                attn_mask: torch.Tensor | None = None, average_attn_weights: bool = True,
                is_causal: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Attention of ``query`` over ``key``/``value``, exactly as ``nn.MultiheadAttention``.

        Args:
            query: ``(L, B, E)``, ``(B, L, E)`` when ``batch_first``, or unbatched ``(L, E)``.
            key: ``(S, B, kdim)`` / ``(B, S, kdim)`` / ``(S, kdim)``.
            value: ``(S, B, vdim)`` / ``(B, S, vdim)`` / ``(S, vdim)``.
            key_padding_mask: ``(B, S)`` (or ``(S,)`` unbatched), bool (True = ignore) or float
                (added to the scores).
            need_weights: also return the attention weights.
            attn_mask: ``(L, S)`` or ``(B*num_heads, L, S)``, bool or float like the padding mask.
            average_attn_weights: average the returned weights over heads.
            is_causal: hint that ``attn_mask`` is the causal mask (it must be given).

        Returns:
            ``(attn_output, attn_weights)``: output in the layout of ``query``; weights
            ``(B, L, S')`` averaged or ``(B, num_heads, L, S')`` per head, ``S'`` counting the
            bias and zero steps, or None when ``need_weights`` is False.
        """
        where = "DPMultiheadAttention.forward"
        is_batched = query.dim() == 3
        if query.dim() not in (2, 3) or key.dim() != query.dim() or value.dim() != query.dim():
            raise ConfigError(f"{where}: query, key and value must all be 3-D (batched) or 2-D "
                              f"(unbatched), got shapes {tuple(query.shape)}, {tuple(key.shape)}, "
                              f"{tuple(value.shape)}")
        if is_causal and attn_mask is None:
            raise ConfigError(f"{where}: is_causal=True needs attn_mask (the causal mask itself); "
                              "nn.Transformer.generate_square_subsequent_mask builds one")
        batch_dim = 0 if self.batch_first else 1
        if not is_batched:
            query, key, value = (t.unsqueeze(batch_dim) for t in (query, key, value))
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        tracker = active_tracker()
        if key_padding_mask is not None and tracker is not None and tracker.is_batched(key_padding_mask):
            # (B, S) whatever the layout (torch's convention): a time-major batch whose source length
            # equals N*K has the caller's mask marked on the layout's axis 1.
            tracker.mark(key_padding_mask, 0)
        for name, tensor, size in (("query", query, self.embed_dim), ("key", key, self.kdim),
                                   ("value", value, self.vdim)):
            if tensor.shape[-1] != size:
                raise ConfigError(f"{where}: {name} must have {size} features, got shape "
                                  f"{tuple(tensor.shape)}")
        if key.shape[:2] != value.shape[:2] or query.shape[batch_dim] != key.shape[batch_dim]:
            raise ConfigError(f"{where}: query {tuple(query.shape)}, key {tuple(key.shape)} and "
                              f"value {tuple(value.shape)} disagree on batch or source length")

        q = self.q_proj(query)  # (L, B, E) or (B, L, E)
        k = self.k_proj(key)  # (S, B, E) or (B, S, E)
        v = self.v_proj(value)  # (S, B, E) or (B, S, E)
        if self.seq_bias_k is not None and self.seq_bias_v is not None:
            k = self.seq_bias_k(k)  # S -> S+1
            v = self.seq_bias_v(v)
        if not self.batch_first:
            q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # (B, *, E)
        B, L, _ = q.shape
        S = key.shape[1 - batch_dim]
        H, hd = self.num_heads, self.head_dim
        q = q.reshape(B, L, H, hd).transpose(1, 2)  # (B, H, L, hd)
        k = k.reshape(B, k.shape[1], H, hd).transpose(1, 2)  # (B, H, S', hd)
        v = v.reshape(B, v.shape[1], H, hd).transpose(1, 2)  # (B, H, S', hd)
        if self.add_zero_attn:
            zeros = torch.zeros(B, H, 1, hd, dtype=k.dtype, device=k.device)
            k = torch.cat([k, zeros], dim=2)  # (B, H, S'+1, hd)
            v = torch.cat([v, zeros], dim=2)
        src_len = k.shape[2]
        mask = self._merged_mask(key_padding_mask, attn_mask, B=B, L=L, S=S, src_len=src_len,
                                 dtype=q.dtype)  # broadcastable to (B, H, L, S'), or None

        dropout = self.dropout if self.training else 0.0
        weights: torch.Tensor | None = None
        # Under torch.func transforms (the functorch backend's vmap) the fused kernel has no
        # batching rule and would run sample by sample: the explicit form is faster there.
        if need_weights or torch._C._are_functorch_transforms_active():
            scores = torch.matmul(q * (1.0 / math.sqrt(hd)), k.transpose(-2, -1))  # (B, H, L, S')
            if mask is not None:
                scores = scores + mask
            weights = torch.softmax(scores, dim=-1)  # (B, H, L, S')
            if dropout > 0.0:
                weights = F.dropout(weights, p=dropout)  # returned after dropout, as torch does
            context = torch.matmul(weights, v)  # (B, H, L, hd)
        else:
            # The fused kernel keeps no (L, S') weights for backward: less memory, same result.
            context = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout)  # (B, H, L, hd)
        context = context.transpose(1, 2).reshape(B, L, self.embed_dim)  # (B, L, E)
        if not self.batch_first:
            context = context.transpose(0, 1)  # (L, B, E)
        output = self.out_proj(context)  # query's layout

        returned: torch.Tensor | None = None
        if weights is not None:
            returned = weights.mean(dim=1) if average_attn_weights else weights
        if not is_batched:
            output = output.squeeze(batch_dim)
            returned = returned.squeeze(0) if returned is not None else None
        return output, returned

    def _merged_mask(self, key_padding_mask: torch.Tensor | None, attn_mask: torch.Tensor | None,
                     *, B: int, L: int, S: int, src_len: int,
                     dtype: torch.dtype) -> torch.Tensor | None:
        """One additive mask broadcastable to ``(B, H, L, src_len)``; extra steps are unmasked."""
        where = "DPMultiheadAttention.forward"
        extra = src_len - S  # bias_k step and zero-attention step are never masked
        merged: torch.Tensor | None = None
        if attn_mask is not None:
            mask = _float_mask(attn_mask, dtype, name="attn_mask")
            if mask.dim() == 2 and mask.shape == (L, S):
                merged = F.pad(mask, (0, extra)).view(1, 1, L, src_len)  # (1, 1, L, S')
            elif mask.dim() == 3 and mask.shape == (B * self.num_heads, L, S):
                merged = F.pad(mask, (0, extra)).view(B, self.num_heads, L, src_len)  # (B, H, L, S')
            else:
                raise ConfigError(f"{where}: attn_mask must have shape {(L, S)} or "
                                  f"{(B * self.num_heads, L, S)}, got {tuple(attn_mask.shape)}")
        if key_padding_mask is not None:
            if key_padding_mask.shape != (B, S):
                raise ConfigError(f"{where}: key_padding_mask must have shape {(B, S)}, got "
                                  f"{tuple(key_padding_mask.shape)}")
            padding = _float_mask(key_padding_mask, dtype, name="key_padding_mask")
            padding = F.pad(padding, (0, extra)).view(B, 1, 1, src_len)  # (B, 1, 1, S')
            merged = padding if merged is None else merged + padding
        return merged


def _from_torch_state_dict(module: nn.Module, state_dict: dict[str, Any], prefix: str,
                           *args: Any) -> None:
    """Rewrites ``nn.MultiheadAttention`` keys under ``prefix`` into this module's keys."""
    names = ("q_proj", "k_proj", "v_proj")
    fused = state_dict.pop(prefix + "in_proj_weight", None)
    if fused is not None:
        for name, weight in zip(names, fused.chunk(3, dim=0)):
            state_dict[f"{prefix}{name}.weight"] = weight
    for name in names:
        separate = state_dict.pop(f"{prefix}{name}_weight", None)
        if separate is not None:
            state_dict[f"{prefix}{name}.weight"] = separate
    fused_bias = state_dict.pop(prefix + "in_proj_bias", None)
    if fused_bias is not None:
        for name, bias in zip(names, fused_bias.chunk(3, dim=0)):
            state_dict[f"{prefix}{name}.bias"] = bias
    for which in ("k", "v"):
        sequence_bias = state_dict.pop(f"{prefix}bias_{which}", None)
        if sequence_bias is not None:
            # torch keeps (1, 1, E); SequenceBias keeps (E,)
            state_dict[f"{prefix}seq_bias_{which}.bias"] = sequence_bias.reshape(-1)
