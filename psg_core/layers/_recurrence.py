"""The time loop of the DP recurrent layers, run outside autograd with a hand-written backward.

A layer direction computes ``gx = ih(x)`` on the whole sequence (one hooked Linear call), then
the recurrence. Tracking the recurrence op by op (a dozen autograd nodes per time step, each with
Python overhead) made DPLSTM 2.5x slower than torch's fused kernel, so here:

1. the forward loop runs without autograd (:func:`run`): per step one ``addmm`` with the
   pre-transposed hidden weight and a few pointwise ops; it keeps what the backward needs and
   the state before every step, ``h_prev`` ``(B, T, H)``. An unmasked layer, the common case,
   runs the whole loop, forward and backward, as one call of psg's C loop where it builds
   (:mod:`psg_core.native`), its results in time-major buffers (the LSTM's also step by step:
   :func:`_lstm_loop`);
2. ``gh = hh(h_prev)`` is one hooked Linear call on that sequence: the same values the loop
   used, computed once more so that ``hh`` sits in the graph like any Linear (hooks, ghost,
   functorch and ExpandedWeights all see an ordinary ``(B, T, H) -> (B, T, G*H)`` call);
3. :class:`_Recurrence` ties ``gx``, ``gh`` and the initial state to the loop's outputs; its
   backward runs the backward recurrence by hand (derivatives precomputed for all steps at once,
   then per step a couple of pointwise ops and one matmul with ``W_hh``) and returns the gate
   gradients, which the two Linear layers turn into (per-sample) parameter gradients.

The gradient of ``hh``'s parameters is exact: ``dL/dW_hh = sum_t dL/dgh_t^T h_{t-1}`` where
``dL/dgh_t`` is the total derivative through all later steps, which the backward recurrence
gives; ``h_prev`` is detached because the loop already accounts for ``h_{t-1}``'s dependence on
earlier steps.

Masked (packed) batches: a sample's state stops changing after its last step (``where``) and its
outputs there are zero; the backward passes the state's gradient through those steps unchanged.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

import psg_core.native as native
from psg_core._autograd import PositionalFunction
from psg_core.gemm import Projection, linear, linear_uses_onednn, mm_tn, onednn_linear

__all__ = ["run", "known_linear", "fast_linear"]


def _plain(param: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """The parameter's values outside any autograd graph (ExpandedWeights unwrapped)."""
    if param is None:
        return None
    return getattr(param, "orig_weight", param).detach().to(dtype)


def _wrapped(tensor: torch.Tensor) -> bool:
    """A tensor of a ``torch.func`` transform (vmap, grad)."""
    return bool(torch._C._functorch.is_functorch_wrapped_tensor(tensor))


def _stack(items: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack(items, dim=1)  # (B, T, ...)


# ---------------------------------------------------------------------------------- forward loops
# One step of each cell: (input gates x_t, hidden gates gh = hh(h), state) -> the new state (h
# first) and what its backward needs, all (B, ·).
Step = Callable[[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]],
                tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]]


def _lstm_step(x: torch.Tensor, gh: torch.Tensor, state: tuple[torch.Tensor, ...]
               ) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    c = state[1]
    hidden = c.shape[1]
    gates = x + gh  # (B, 4H): i, f, g, o
    s = torch.sigmoid(gates)
    g = torch.tanh(gates[:, 2 * hidden:3 * hidden])
    c_new = torch.addcmul(s[:, hidden:2 * hidden] * c, s[:, :hidden], g)
    tc = torch.tanh(c_new)
    return (s[:, 3 * hidden:] * tc, c_new), (s, g, c, tc)


def _gru_step(x: torch.Tensor, gh: torch.Tensor, state: tuple[torch.Tensor, ...]
              ) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    h = state[0]
    hidden = h.shape[1]
    rz = torch.sigmoid(x[:, :2 * hidden] + gh[:, :2 * hidden])  # (B, 2H): r, z
    h_n = gh[:, 2 * hidden:]
    n = torch.tanh(torch.addcmul(x[:, 2 * hidden:], rz[:, :hidden], h_n))
    h_new = torch.addcmul(n, rz[:, hidden:], h - n)  # (1 - z) n + z h
    return (h_new,), (rz, n, h_n)  # its backward also reads h_prev, which the loop keeps anyway


def _rnn_step(act: Callable[[torch.Tensor], torch.Tensor]) -> Step:
    def step(x: torch.Tensor, gh: torch.Tensor, state: tuple[torch.Tensor, ...]
             ) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        h_new = act(x + gh)  # (B, H)
        return (h_new,), (h_new,)
    return step


def _loop(step: Step, gx: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
          state: tuple[torch.Tensor, ...], mask: torch.Tensor | None, order: range
          ) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """Runs ``step`` over the sequence in ``order``: ``((h_prev, hh outputs), final state,
    (outputs, *saved))``, all ``(B, T, ·)`` in time order. A masked-out step keeps the state and
    outputs zeros. ``weight`` is the hidden weight ``(G*H, H)``."""
    steps = gx.shape[1]
    hh = Projection(weight, state[0], None, bias)
    gx_steps = gx.unbind(1)  # T x (B, G*H)
    valid = None if mask is None else mask.unsqueeze(2).unbind(1)  # T x (B, 1)
    h = state[0]
    outs: list[torch.Tensor] = [h] * steps
    h_prev: list[torch.Tensor] = [h] * steps
    hidden_gates: list[torch.Tensor] = [h] * steps
    saved: list[list[torch.Tensor]] = []
    for t in order:
        h = state[0]
        gh = hh(None, h)  # hh(h)
        new, keep = step(gx_steps[t], gh, state)
        if not saved:
            saved = [[h] * steps for _ in keep]
        for values, value in zip(saved, keep):
            values[t] = value
        h_prev[t], hidden_gates[t] = h, gh
        if valid is None:
            state = new
            outs[t] = new[0]
        else:
            v = valid[t]
            state = tuple(torch.where(v, n, o) for n, o in zip(new, state))
            outs[t] = new[0] * v
    return (_stack(h_prev), _stack(hidden_gates)), state, (_stack(outs), *(_stack(v) for v in saved))


def _native_cell(kind: str, relu: bool) -> str:
    """The cell's name in :data:`psg_core.native.CELLS` (an RNN's is its nonlinearity)."""
    return kind if kind != "rnn" else ("relu" if relu else "tanh")


def _native_loop(lib: Any, cell: str, gx: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 h0: torch.Tensor, order: range
                 ) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, ...],
                            tuple[torch.Tensor, ...]] | None:
    """:func:`_loop` of an unmasked GRU or RNN (``cell``: ``"gru"``, ``"tanh"`` or ``"relu"``) as
    one call of :mod:`psg_core.native`'s C loop, with what :func:`_loop` returns (the ``(B, T, ·)``
    results views of time-major buffers); None where the call could not run."""
    batch, steps, width = gx.shape
    hidden = h0.shape[1]
    forward = order.step > 0
    hs = gx.new_empty(steps + 1, batch, hidden)  # the states: slot 0 (forward) or T (reverse) is the first
    hs[0 if forward else steps] = h0
    hidden_gates = gx.new_empty(batch, steps, width)  # hh(h_prev) = W_hh h + b_hh
    gru = cell == "gru"
    rz = gx.new_empty(steps, batch, 2 * hidden) if gru else None
    cand = gx.new_empty(steps, batch, hidden) if gru else None
    if not native.forward(lib, cell, gx, weight, bias, hidden_gates, hs, not forward, act=rz, cand=cand):
        return None
    prev, new = (slice(0, steps), slice(1, steps + 1)) if forward else (slice(1, steps + 1), slice(0, steps))
    outs = hs[new].transpose(0, 1)  # (B, T, H) views
    saved: tuple[torch.Tensor, ...]
    if gru:
        assert rz is not None and cand is not None
        saved = (rz.transpose(0, 1), cand.transpose(0, 1), hidden_gates[..., 2 * hidden:])
    else:
        saved = (hs[new].transpose(0, 1),)  # the outputs again, as another view (autograd returns one, saves one)
    return (hs[prev].transpose(0, 1), hidden_gates), (hs[steps if forward else 0],), (outs, *saved)


def _lstm_loop(gx: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, state: tuple[torch.Tensor, ...],
               order: range) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, ...],
                                      tuple[torch.Tensor, ...]]:
    """:func:`_loop` of an unmasked LSTM, with what it returns written in place: every step's
    results go straight into time-major ``(T, B, ·)`` buffers, and the ``(B, T, ·)`` results are
    views of those buffers. The loop is one call of :mod:`psg_core.native`'s C loop where that
    applies, else :func:`_lstm_steps`.
    Plain tensors only (not under ``torch.func`` transforms, whose wrapped tensors cannot be
    written into plain buffers, nor under autocast, which would change ``addmm``'s dtype)."""
    batch, steps, width = gx.shape
    hidden = width // 4
    forward = order.step > 0
    sig = gx.new_empty(steps, batch, width)
    cand = gx.new_empty(steps, batch, hidden)
    tanh_c = gx.new_empty(steps, batch, hidden)
    hs = gx.new_empty(steps + 1, batch, hidden)  # the states: slot 0 (forward) or T (reverse) is the first
    cs = gx.new_empty(steps + 1, batch, hidden)
    first = 0 if forward else steps
    hs[first], cs[first] = state
    tensors = (gx, weight) if bias is None else (gx, weight, bias)
    lib = native.library() if native.applies(*tensors) else None
    hidden_gates: torch.Tensor | None = None  # hh(h_prev) = W_hh h + b_hh
    if lib is not None:
        hidden_gates = gx.new_empty(batch, steps, width)
        if not native.forward(lib, "lstm", gx, weight, bias, hidden_gates, hs, not forward, act=sig, cand=cand,
                              tanh_c=tanh_c, cs=cs):
            hidden_gates = None
    if hidden_gates is None:
        hidden_gates = _lstm_steps(gx, weight, bias, order, sig, cand, tanh_c, hs, cs)
    prev, new = (slice(0, steps), slice(1, steps + 1)) if forward else (slice(1, steps + 1), slice(0, steps))
    h_prev = hs[prev].transpose(0, 1)  # (B, T, H) views
    final = (hs[steps if forward else 0], cs[steps if forward else 0])
    return ((h_prev, hidden_gates), final,
            (hs[new].transpose(0, 1), sig.transpose(0, 1), cand.transpose(0, 1), cs[prev].transpose(0, 1),
             tanh_c.transpose(0, 1)))


def _lstm_steps(gx: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, order: range,
                sig: torch.Tensor, cand: torch.Tensor, tanh_c: torch.Tensor, hs: torch.Tensor, cs: torch.Tensor
                ) -> torch.Tensor:
    """:func:`_lstm_loop`'s time loop step by step, in torch ops (where :mod:`psg_core.native` has no
    kernel): writes the time-major buffers, returns ``hh(h_prev)`` ``(B, T, 4H)``. A step is seven
    ops: the gates buffer starts as input gates + hidden bias, and ``addmm_`` adds ``W_hh h``; with
    oneDNN's product (:mod:`psg_core.gemm`) each step's gates are a new tensor, stacked once after
    the loop."""
    batch, steps, width = gx.shape
    hidden = width // 4
    forward = order.step > 0
    gates = gx.new_empty(steps, batch, width)  # input gates + hidden bias, then + W_hh h step by step
    if bias is None:
        gates.copy_(gx.transpose(0, 1))
    else:
        torch.add(gx.transpose(0, 1), bias, out=gates)
    i, f, o = (sig[..., k * hidden:(k + 1) * hidden].unbind(0) for k in (0, 1, 3))
    gates_t, sig_t, cand_t, tanh_t, h_t, c_t = (b.unbind(0) for b in (gates, sig, cand, tanh_c, hs, cs))
    hh = Projection(weight, h_t[0 if forward else steps], gates_t[0])
    # oneDNN's product returns each step's gates as a new tensor (kept, stacked after the loop);
    # torch's adds W_hh h into the gates buffer in place
    new_gates: list[torch.Tensor] = list(gates_t)
    for t in order:
        read, write = (t, t + 1) if forward else (t + 1, t)
        step_gates = new_gates[t] = hh(gates_t[t], h_t[read]) if hh.onednn else gates_t[t].addmm_(h_t[read], hh.weight)
        torch.sigmoid(step_gates, out=sig_t[t])
        torch.tanh(step_gates[:, 2 * hidden:3 * hidden], out=cand_t[t])
        torch.mul(f[t], c_t[read], out=c_t[write]).addcmul_(i[t], cand_t[t])
        torch.mul(o[t], torch.tanh(c_t[write], out=tanh_t[t]), out=h_t[write])
    # hh(h_prev) = W_hh h + b_hh
    return torch.stack(new_gates, 1).sub_(gx) if hh.onednn else gates.transpose(0, 1) - gx


# ------------------------------------------------------------------------------ backward recurrences
def _masked(dh: torch.Tensor, dout: torch.Tensor, v: torch.Tensor | None
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gradient reaching the step's new state, and the part that passes the step unchanged."""
    if v is None:
        return dh + dout, None
    return (dh + dout) * v, dh * (1.0 - v)


def _lstm_backward(saved: Sequence[torch.Tensor], weight: torch.Tensor, valid: Sequence[torch.Tensor] | None,
                   order: range, d_out: torch.Tensor, dh: torch.Tensor, dc: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(d gates (B, T, 4H), d h0, d c0)``. Every step's local derivatives are computed at once
    (time-major, so that a step's slice is contiguous); the loop keeps what depends on later steps
    and writes each step's gate gradients into one ``(B, T, 4, H)`` buffer: per step five ops, the
    next step's output gradient entering through ``addmm``."""
    sig, cand, c_prev, tanh_c = (t.transpose(0, 1) for t in saved)  # (T, B, ·) views
    steps, batch, hidden = cand.shape
    i, f, o = sig[..., :hidden], sig[..., hidden:2 * hidden], sig[..., 3 * hidden:]
    # Written in place into buffers, but for tensors of a torch.func transform (grad's backward
    # runs with a graph one level up, and out= ops do not differentiate): those are stacked.
    in_place = not any(_wrapped(t) or t.requires_grad for t in (d_out, dh, dc, weight, *saved))
    if in_place and valid is None and order:
        # the kernel reads the saved activations and the state gradients (made contiguous there);
        # the output gradients enter through the product only
        lib = native.library() if native.applies(weight, sig, cand, c_prev, tanh_c) else None
        done = None if lib is None else _lstm_backward_native(lib, sig, cand, c_prev, tanh_c, weight, order,
                                                              d_out, dh, dc)
        if done is not None:
            return done
    # d gates_{i,f,g} = dc_new * from_c, d gates_o = dh_new * from_h, dc_new = dc + dh_new * to_c.
    if in_place:  # sigmoid' = s - s*s (one op for the adjacent i and f); from_c written in place
        d_if = torch.addcmul(sig[..., :2 * hidden], sig[..., :2 * hidden], sig[..., :2 * hidden], value=-1.0)
        from_c_all = cand.new_empty(steps, batch, 3, hidden)
        torch.mul(cand, d_if[..., :hidden], out=from_c_all[:, :, 0])
        torch.mul(c_prev, d_if[..., hidden:], out=from_c_all[:, :, 1])
        torch.addcmul(i, i, cand * cand, value=-1.0, out=from_c_all[:, :, 2])  # i (1 - g^2)
        to_c = torch.addcmul(o, o, tanh_c * tanh_c, value=-1.0).unbind(0)  # T x (B, H)
        from_c = from_c_all.unbind(0)  # T x (B, 3, H)
        from_h = (tanh_c * torch.addcmul(o, o, o, value=-1.0)).unbind(0)  # T x (B, H)
    else:
        to_c = (o * (1.0 - tanh_c * tanh_c)).unbind(0)
        from_c = torch.stack([cand * i * (1.0 - i), c_prev * f * (1.0 - f), i * (1.0 - cand * cand)],
                             dim=2).unbind(0)
        from_h = (tanh_c * o * (1.0 - o)).unbind(0)
    forget = f.unbind(0)
    dgates = cand.new_empty(batch, steps, 4, hidden) if in_place else None
    dg: list[torch.Tensor] = (list(dgates.view(batch, steps, 4 * hidden).unbind(1)) if dgates is not None
                              else [dh] * steps)  # T x (B, 4H)
    dg_c = dgates[:, :, :3].unbind(1) if dgates is not None else ()  # T x (B, 3, H) views
    dg_h = dgates[:, :, 3].unbind(1) if dgates is not None else ()  # T x (B, H) views
    if valid is not None:  # a masked-out step's output is zero: no gradient enters there
        d_out = d_out * torch.stack(list(valid), 1)
    douts = d_out.unbind(1)
    backwards = list(reversed(order))
    if not backwards:
        return cand.new_zeros(batch, steps, 4 * hidden), dh, dc
    dh = dh + douts[backwards[0]]  # the gradient reaching the step's new state, its output's included
    hh_t: Projection | None = None  # x -> x @ W_hh, made at the first step (its operands decide the kernel)
    for k, t in enumerate(backwards):
        if valid is None:
            dh_new, dc_in = dh, dc
        else:  # the state passes a masked-out step unchanged
            v = valid[t]
            dh_new, dc_in = dh * v, dc * v
        dc_new = torch.addcmul(dc_in, dh_new, to_c[t])  # the new c's total gradient
        if dgates is not None:
            torch.mul(dc_new.unsqueeze(1), from_c[t], out=dg_c[t])
            torch.mul(dh_new, from_h[t], out=dg_h[t])
        else:
            dg[t] = torch.cat([dc_new.unsqueeze(1) * from_c[t], (dh_new * from_h[t]).unsqueeze(1)],
                              dim=1).view(batch, 4 * hidden)
        dc_next = dc_new * forget[t]
        next_out = douts[backwards[k + 1]] if k + 1 < len(backwards) else None
        if hh_t is None:
            hh_t = Projection(weight.t(), dg[t], next_out)
        dh_next = hh_t(next_out, dg[t])
        if valid is not None:
            passes = 1.0 - valid[t]
            dh_next = torch.addcmul(dh_next, dh, passes)
            dc_next = torch.addcmul(dc_next, dc, passes)
        dh, dc = dh_next, dc_next
    return (dgates.view(batch, steps, 4 * hidden) if dgates is not None else _stack(dg)), dh, dc


def _lstm_backward_native(lib: Any, act: torch.Tensor, cand: torch.Tensor, c_prev: torch.Tensor,
                          tanh_c: torch.Tensor, weight: torch.Tensor, order: range, d_out: torch.Tensor,
                          dh: torch.Tensor, dc: torch.Tensor
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """:func:`_lstm_backward` of an unmasked LSTM as one call of :mod:`psg_core.native`'s loop;
    None where the call could not run (the caller falls back). ``act``, ``cand``, ``c_prev`` and
    ``tanh_c`` are time-major ``(T, B, ·)`` views; of ``act`` (the gates' sigmoids) only the i, f
    and o slots are read."""
    steps, batch, hidden = tanh_c.shape
    if d_out.stride(-1) != 1:
        d_out = d_out.contiguous()
    dgates = act.new_empty(batch, steps, 4 * hidden)
    dh0 = dh.contiguous().clone()  # the final state's gradients in, the initial state's out
    dc0 = dc.contiguous().clone()
    if not native.backward(lib, "lstm", weight.contiguous(), d_out, dh0, dgates, order.step < 0, dc=dc0, act=act,
                           cand=cand, tanh_c=tanh_c, cs=c_prev):
        return None
    return dgates, dh0, dc0


def _rnn_backward_native(spec: "_Spec", saved: Sequence[torch.Tensor], weight: torch.Tensor,
                         valid: Sequence[torch.Tensor] | None, d_out: torch.Tensor, dh: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The backward recurrence of an unmasked GRU or RNN as one call of :mod:`psg_core.native`'s
    C loop: ``(d input gates, d hidden gates, d h0)``, ``(B, T, G*H)`` each (one tensor for the
    RNN, whose two are equal); None where it does not apply (the caller falls back)."""
    if valid is None and spec.order and not any(_wrapped(t) or t.requires_grad for t in (d_out, dh, weight, *saved)):
        lib = native.library() if native.applies(weight, *saved) else None
    else:
        lib = None
    if lib is None:
        return None
    batch, steps, hidden = d_out.shape
    if d_out.stride(-1) != 1:
        d_out = d_out.contiguous()
    dh0 = dh.contiguous().clone()  # the final state's gradient in, the initial state's out
    reverse = spec.order.step < 0
    if spec.kind == "gru":
        rz, cand, hidden_n, h_prev = (t.transpose(0, 1) for t in saved)  # (T, B, ·) views
        d_input, d_hidden = (d_out.new_empty(batch, steps, 3 * hidden) for _ in range(2))
        if not native.backward(lib, "gru", weight.contiguous(), d_out, dh0, d_input, reverse, d_hidden=d_hidden,
                               act=rz, cand=cand, tanh_c=hidden_n, hs=h_prev):
            return None
        return d_input, d_hidden, dh0
    (new,) = saved
    d_pre = d_out.new_empty(batch, steps, hidden)
    if not native.backward(lib, _native_cell(spec.kind, spec.relu), weight.contiguous(), d_out, dh0, d_pre, reverse,
                           hs=new.transpose(0, 1)):
        return None
    return d_pre, d_pre, dh0


def _gru_backward(saved: Sequence[torch.Tensor], weight: torch.Tensor, valid: Sequence[torch.Tensor] | None,
                  order: range, d_out: Sequence[torch.Tensor], dh: torch.Tensor
                  ) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
    rz, cand, hidden_n, h_prev = saved
    hidden = cand.shape[2]
    r, z = rz[..., :hidden], rz[..., hidden:]
    to_n = ((1.0 - z) * (1.0 - cand * cand)).unbind(1)  # d pre_n = dh * (1 - z) tanh'(n)
    to_z = ((h_prev - cand) * z * (1.0 - z)).unbind(1)  # d pre_z = dh * (h - n) z'
    to_r = (hidden_n * r * (1.0 - r)).unbind(1)  # d pre_r = d pre_n * h_n r'
    keep = z.unbind(1)  # dh_prev += dh * z
    reset = r.unbind(1)  # d h_n = d pre_n * r
    d_input: list[torch.Tensor] = [dh] * len(d_out)
    d_hidden: list[torch.Tensor] = [dh] * len(d_out)
    hh_t: Projection | None = None  # x -> x @ W_hh
    for t in reversed(order):
        v = None if valid is None else valid[t]
        dh_new, dh_keep = _masked(dh, d_out[t], v)
        d_n = dh_new * to_n[t]
        d_z = dh_new * to_z[t]
        d_r = d_n * to_r[t]
        d_input[t] = torch.cat([d_r, d_z, d_n], dim=1)  # (B, 3H)
        d_hidden[t] = torch.cat([d_r, d_z, d_n * reset[t]], dim=1)
        kept = dh_new * keep[t]
        if hh_t is None:
            hh_t = Projection(weight.t(), d_hidden[t], kept)
        dh = hh_t(kept, d_hidden[t])
        if dh_keep is not None:
            dh = dh + dh_keep
    return d_input, d_hidden, dh


def _rnn_backward(saved: Sequence[torch.Tensor], weight: torch.Tensor, valid: Sequence[torch.Tensor] | None,
                  order: range, d_out: Sequence[torch.Tensor], dh: torch.Tensor, relu: bool
                  ) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
    (new,) = saved
    slope = ((new > 0).to(new.dtype) if relu else 1.0 - new * new).unbind(1)
    d_pre: list[torch.Tensor] = [dh] * len(d_out)
    hh_t: Projection | None = None  # x -> x @ W_hh
    for t in reversed(order):
        v = None if valid is None else valid[t]
        dh_new, dh_keep = _masked(dh, d_out[t], v)
        d_pre[t] = dh_new * slope[t]
        if hh_t is None:
            hh_t = Projection(weight.t(), d_pre[t], None)
        dh = hh_t(None, d_pre[t])
        if dh_keep is not None:
            dh = dh + dh_keep
    return d_pre, d_pre, dh


# ------------------------------------------------------------------------------------ the Function
def _refuse_double_backward(grad: torch.Tensor) -> None:
    """The backward recurrence uses activations saved without autograd: its result is right, but a
    graph of it (``create_graph=True``) would miss their dependence on the parameters, so second
    derivatives are refused rather than silently wrong. (torch.func's ``grad`` also differentiates
    with a graph, one level up: its wrapped tensors are the first-order case, and pass.)"""
    if (torch.is_grad_enabled() and grad.requires_grad
            and not _wrapped(grad)):
        from psg_core.errors import UnsupportedModuleError
        raise UnsupportedModuleError(
            "DP recurrent layers (DPRNN, DPGRU, DPLSTM) are differentiable once: second derivatives "
            "through them (backward with create_graph=True) are not supported")


class _Spec:
    """What a direction's backward needs besides tensors: the cell kind and the step order."""

    __slots__ = ("kind", "relu", "order")

    def __init__(self, kind: str, relu: bool, order: range) -> None:
        self.kind = kind
        self.relu = relu
        self.order = order


class _Recurrence(PositionalFunction):
    """Identity on the loop's results (computed without autograd); its backward is the backward
    recurrence, returning the gradients of ``gx``, ``gh`` and the initial state.

    Inputs: ``gx, gh, h0, c0`` (c0 None but for LSTM), the spec, the hidden weight ``(G*H, H)``,
    the step mask (or None), then the results (output sequence, final h, final c or None) and the
    saved activations. The results are returned as they are (autograd makes them views).
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(gx: torch.Tensor, gh: torch.Tensor, h0: torch.Tensor, c0: torch.Tensor | None,
                spec: _Spec, weight: torch.Tensor, mask: torch.Tensor | None, out: torch.Tensor,
                h_n: torch.Tensor, c_n: torch.Tensor | None, *saved: torch.Tensor
                ) -> tuple[torch.Tensor, ...]:
        return (out, h_n) if c_n is None else (out, h_n, c_n)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        gx, gh, h0, c0, spec, weight, mask, out = inputs[:8]
        ctx.spec = spec
        ctx.dtypes = (gx.dtype, gh.dtype, h0.dtype, None if c0 is None else c0.dtype, out.dtype)
        ctx.save_for_backward(weight, mask, *inputs[10:])

    @staticmethod
    def backward(ctx: Any, d_out: torch.Tensor, d_h: torch.Tensor, d_c: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor | None, ...]:
        spec: _Spec = ctx.spec
        _refuse_double_backward(d_out)
        gx_dtype, gh_dtype, h_dtype, c_dtype, dt = ctx.dtypes
        weight, mask, *saved = ctx.saved_tensors
        weight = weight.to(dt)
        saved = [t.to(dt) for t in saved]
        valid = None if mask is None else mask.to(dt).unsqueeze(2).unbind(1)  # T x (B, 1)
        saved = list(saved)
        dh = d_h.to(dt)
        dc0: torch.Tensor | None = None
        if spec.kind == "lstm":
            assert d_c is not None
            d_gates, dh0, dc = _lstm_backward(saved, weight, valid, spec.order, d_out.to(dt), dh, d_c.to(dt))
            dc0 = dc.to(c_dtype)
            dgx = d_gates.to(gx_dtype)
            dgh = dgx if gh_dtype == gx_dtype else d_gates.to(gh_dtype)
        else:
            native_done = _rnn_backward_native(spec, saved, weight, valid, d_out.to(dt), dh)
            if native_done is not None:
                d_in, d_hid, dh0 = native_done
                dgx = d_in.to(gx_dtype)
                dgh = dgx if d_hid is d_in and gh_dtype == gx_dtype else d_hid.to(gh_dtype)
                return (dgx, dgh, dh0.to(h_dtype), None, None, None, None, None, None, None,
                        *([None] * len(saved)))
            douts = d_out.to(dt).unbind(1)
            if spec.kind == "gru":
                d_input, d_hidden, dh0 = _gru_backward(saved, weight, valid, spec.order, douts, dh)
            else:
                d_input, d_hidden, dh0 = _rnn_backward(saved, weight, valid, spec.order, douts, dh,
                                                       spec.relu)
            dgx = _stack(d_input).to(gx_dtype)
            dgh = dgx if d_hidden is d_input and gh_dtype == gx_dtype else _stack(d_hidden).to(gh_dtype)
        return (dgx, dgh, dh0.to(h_dtype), dc0, None, None, None, None, None, None,
                *([None] * len(saved)))


# ------------------------------------------------------------------------- hh with a known output
class _KnownOutput(PositionalFunction):
    """``F.linear(input, weight, bias)`` whose value is already known (the recurrence computed it
    step by step): returns it, and differentiates like ``F.linear``."""

    generate_vmap_rule = True

    @staticmethod
    def forward(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                output: torch.Tensor) -> torch.Tensor:
        return output

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        input, weight, bias, _ = inputs
        ctx.dtypes = (input.dtype, weight.dtype, None if bias is None else bias.dtype)
        ctx.save_for_backward(input, weight)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        input, weight = ctx.saved_tensors
        input_dtype, weight_dtype, bias_dtype = ctx.dtypes
        dt = grad.dtype
        grad_input = grad_weight = grad_bias = None
        if _engine_needs(ctx, 0):
            grad_input = linear(grad, weight.to(dt).t()).to(input_dtype)
        if _engine_needs(ctx, 1):
            rows = grad.reshape(-1, grad.shape[-1])  # (B*T, out)
            grad_weight = mm_tn(rows, input.reshape(-1, input.shape[-1]).to(dt)).to(weight_dtype)
        if _engine_needs(ctx, 2):
            grad_bias = grad.reshape(-1, grad.shape[-1]).sum(0).to(bias_dtype)
        return grad_input, grad_weight, grad_bias, None


def _engine_needs(ctx: Any, index: int) -> bool:
    """Whether this backward pass uses the gradient of input ``index``: ``needs_input_grad`` says
    only that the input requires one; a pass to chosen tensors (``torch.autograd.grad(loss,
    outputs)``, how the hooks and ghost backends take the layers' output gradients) runs no
    parameter's accumulation, so F.linear's own backward computes no weight gradient there either."""
    if not ctx.needs_input_grad[index]:
        return False
    try:
        node = ctx.next_functions[index][0]
        return node is None or bool(torch._C._will_engine_execute_node(node))
    except (RuntimeError, AttributeError, IndexError, TypeError):
        return True


_KNOWN = "_psg_known_output"


@contextlib.contextmanager
def known_output(linear: torch.nn.Module, input: torch.Tensor, output: torch.Tensor) -> Iterator[None]:
    """While active, ``linear(input)`` for this very ``input`` returns ``output`` without computing
    it (see :func:`known_linear`)."""
    setattr(linear, _KNOWN, (input, output))
    try:
        yield
    finally:
        setattr(linear, _KNOWN, None)


def _tied(linear: torch.nn.Module, input: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
    """``output``, already computed for ``linear(input)``, tied to the graph as F.linear would be."""
    from psg_core.provenance import rowwise
    weight, bias = linear.weight, linear.bias
    return rowwise(lambda x: _KnownOutput.apply(x, weight, bias, output), input)  # type: ignore[no-any-return]


def _plain_weight(linear: torch.nn.Module) -> bool:
    """Whether the layer's weight is a plain tensor (ExpandedWeights compute per-sample gradients in
    F.linear, so they get the ordinary call)."""
    return type(linear.weight) in (torch.Tensor, torch.nn.Parameter)


def known_linear(linear: torch.nn.Module, input: torch.Tensor) -> torch.Tensor | None:
    """The linear layer's output for ``input`` when :class:`known_output` holds it and the
    parameters are plain tensors; None otherwise."""
    known = getattr(linear, _KNOWN, None)
    if known is None or known[0] is not input or not _plain_weight(linear):
        return None
    return _tied(linear, input, known[1])


def fast_linear(linear_layer: torch.nn.Linear, input: torch.Tensor) -> torch.Tensor | None:
    """``linear_layer(input)`` computed by oneDNN where :mod:`psg_core.gemm` takes it (a plain
    float32 CPU call), tied to the graph by :class:`_KnownOutput` (whose backward takes the same
    kernel); None otherwise (the ordinary ``F.linear`` call: other kernels, autocast,
    ExpandedWeights, ``torch.func`` transforms)."""
    if not _plain_weight(linear_layer) or type(input) is not torch.Tensor:
        return None
    bias = linear_layer.bias
    with torch.no_grad():
        plain_input, plain_weight = input.detach(), linear_layer.weight.detach()
        plain_bias = None if bias is None else bias.detach()
        if not linear_uses_onednn(plain_input, plain_weight, plain_bias):
            return None
        output = onednn_linear(plain_input, plain_weight, plain_bias)
    return _tied(linear_layer, input, output)


# --------------------------------------------------------------------------------------- entry
def run(cell: Any, sequence: torch.Tensor, state: Any, mask: torch.Tensor | None, reverse: bool
        ) -> tuple[torch.Tensor, Any]:
    """One direction of a DP recurrent layer: ``sequence`` (B, T, F) -> outputs (B, T, H) (zero
    after a sample's last step when ``mask`` (B, T) is given) and the final state.

    ``cell`` is a DP cell (``ih``/``hh`` RNNLinear layers, ``gates``, for an RNN
    ``nonlinearity``); ``state`` is ``h`` or ``(h, c)``, ``(B, H)`` each.
    """
    from psg_core.precision import autocast_active
    from psg_core.provenance import rowwise

    if sequence.shape[1] == 0:
        from psg_core.errors import ConfigError
        raise ConfigError("DP recurrent layers: the input sequence is empty (length 0); torch's RNNs refuse "
                          "it too (a packed batch's lengths must be at least 1)")
    gx = cell.ih(sequence)  # (B, T, G*H): one hooked call for the whole sequence
    steps = gx.shape[1]
    order = range(steps - 1, -1, -1) if reverse else range(steps)
    kind = {4: "lstm", 3: "gru"}.get(cell.gates, "rnn")
    relu = kind == "rnn" and cell.nonlinearity == "relu"
    h0, c0 = (state if kind == "lstm" else (state, None))
    weight = _plain(cell.hh.weight, gx.dtype)  # (G*H, H)
    assert weight is not None
    bias = _plain(cell.hh.bias, gx.dtype)

    def loop(gx: torch.Tensor) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, ...],
                                        tuple[torch.Tensor, ...]]:
        with torch.no_grad():
            x = gx.detach()
            step: Step
            start: tuple[torch.Tensor, ...]
            if kind == "lstm":
                assert c0 is not None
                step, start = _lstm_step, (h0.detach(), c0.detach())
                if mask is None and not autocast_active() and not _wrapped(x):
                    return _lstm_loop(x, weight, bias, start, order)
            else:
                step = _gru_step if kind == "gru" else _rnn_step(torch.relu if relu else torch.tanh)
                start = (h0.detach(),)
                tensors = (x, weight) if bias is None else (x, weight, bias)
                if mask is None and not autocast_active() and native.applies(*tensors):
                    lib = native.library()
                    done = None if lib is None else _native_loop(lib, _native_cell(kind, relu), x, weight, bias,
                                                                 start[0], order)
                    if done is not None:
                        return done
            return _loop(step, x, weight, bias, start, mask, order)

    (h_prev, gh_values), final, results = rowwise(loop, gx)
    # hh in the graph: one hooked call on the states the loop read, (B, T, H) -> (B, T, G*H); its
    # output is the loop's (known_output), not computed again, where the weight is a plain tensor.
    with known_output(cell.hh, h_prev, gh_values):
        gh = cell.hh(h_prev)
    out, *saved = results
    if kind == "gru":
        saved.append(h_prev)
    spec = _Spec(kind, relu, order)
    c_n = final[1] if kind == "lstm" else None

    def tie(gx: torch.Tensor, gh: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return _Recurrence.apply(gx, gh, h0, c0, spec, weight, mask, out, final[0], c_n, *saved)

    tied = rowwise(tie, gx, gh)
    return tied[0], (tuple(tied[1:]) if kind == "lstm" else tied[1])
