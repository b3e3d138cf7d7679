"""The Hugging Face sweep: every sequence-classification architecture transformers registers, built
tiny, through psg's hooks and ghost modes against the microbatch oracle.

``python -m tests.core.hf_sweep [-K 2] [TYPE ...]`` builds each model type (all of
``MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES`` by default) from one small configuration
(:data:`TINY`: hidden size 16, two layers, two heads, ...; a config ignores the options it does not
know), each in a process of its own (one type's defaults can take gigabytes: a crash or an
out-of-memory ends that type's line only; ``--memory-gib`` caps each process's address space), and prints one line per type:

* ``ok``: psg's per-sample gradients (hooks) and ghost's norms and clipped sum equal the oracle's;
* ``refused``: psg raised a :class:`psg_core.PsgError` (its message follows);
* ``WRONG``: psg returned values the oracle disagrees with, or non-finite ones (exit status 1);
* ``ERROR``: psg raised anything else (exit status 1);
* ``skipped``: the type did not build or run from this configuration, or its oracle could not be
  computed (nothing of psg's ran), or the comparison could not (psg returned; its values unchecked).

A process that dies once psg runs (a crash, a signal) is an ``ERROR``.

The oracle is :func:`tests.core.hf_models.oracle` (float64, each sample's K=1 rows alone); for a
type without float64 kernels (``grouped_mm``) or whose float64 run is not finite, the same loop in
float32. The sweep takes about 20 minutes on two cores; ``make test`` runs :func:`sweep_type` on a
few types (tests/core/test_hf_sweep.py).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

import psg_core
from psg_core import DPConfig, PsgError, dp_gradient, per_sample_gradients
from tests.core import hf_models as hf

__all__ = ["TINY", "SAMPLES", "compare", "sweep_type", "main"]

#: One configuration for every type: the names differ by family (hidden_size, d_model, n_embd,
#: emb_dim...), so all are given.
TINY: dict[str, Any] = dict(
    hidden_size=16, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, intermediate_size=32,
    vocab_size=hf.VOCAB, pad_token_id=hf.PAD, eos_token_id=hf.EOS, bos_token_id=hf.EOS, num_labels=hf.NUM_LABELS,
    max_position_embeddings=32, n_positions=32, type_vocab_size=2, layer_norm_eps=1e-5,
    d_model=16, n_head=2, n_layer=2, n_embd=16, emb_dim=16, n_layers=2, n_heads=2, num_layers=2, num_heads=2,
    d_ff=32, d_kv=8, ffn_dim=32, d_inner=32, d_head=8, head_dim=8, embedding_size=16,
    encoder_layers=2, decoder_layers=2, encoder_attention_heads=2, decoder_attention_heads=2,
    encoder_ffn_dim=32, decoder_ffn_dim=32, entity_vocab_size=40, entity_emb_size=16,
    hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, dropout=0.0, attention_dropout=0.0,
    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, classifier_dropout=0.0, dropout_rate=0.0)
SAMPLES = 4  # N; the batch holds N*K rows, each sample's K copies together
#: psg's values against the oracle's: the largest difference over the largest oracle entry of the
#: model (float32 against float64 through two blocks)
TOLERANCE = 1e-3
BOUND = 0.05  # ghost's clipping bound (clips every sample of these models)


def compare(grads: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> float | None:
    """The largest ``|grads - expected|`` over the largest ``|expected|`` entry of all tensors;
    None when a value on either side is not finite."""
    scale = max((float(ref.abs().max()) for ref in expected.values() if ref.numel()), default=0.0)
    worst = 0.0
    for name, ref in expected.items():
        got = grads[name].to(torch.float64)
        if not (bool(torch.isfinite(ref).all()) and bool(torch.isfinite(got).all())):
            return None
        if ref.numel():
            worst = max(worst, float((got - ref).abs().max()) / max(scale, 1e-30))
    return worst


def _oracle(model: torch.nn.Module, inputs: dict[str, torch.Tensor], labels: torch.Tensor, K: int
            ) -> tuple[dict[str, torch.Tensor], str]:
    try:
        oracle = hf.oracle(model, inputs, labels, K)
        if all(bool(torch.isfinite(g).all()) for g in oracle.values()):
            return oracle, "float64"
        why = "float64 run not finite"
    except RuntimeError as err:
        why = f"no float64 run: {str(err)[:80]}"
    float32 = hf.oracle(model, inputs, labels, K, dtype=torch.float32)
    return {name: g.to(torch.float64) for name, g in float32.items()}, f"float32 ({why})"


def _run_mode(model: torch.nn.Module, inputs: dict[str, torch.Tensor], labels: torch.Tensor,
              oracle: dict[str, torch.Tensor], mode: str, K: int) -> str:
    try:
        if mode == "ghost":
            reference = psg_core.clip_and_sum({n: g.float() for n, g in oracle.items()}, max_grad_norm=BOUND)
            result = dp_gradient(model, inputs, labels, loss_fn=hf.loss_fn,
                                 config=DPConfig(mode="ghost", max_grad_norm=BOUND, augmentation_multiplicity=K))
            grads = {**result.grads, "<norms>": result.per_sample_norms}
            expected = {**{n: g.double() for n, g in reference.grads.items()},
                        "<norms>": reference.per_sample_norms.double()}
        else:
            grads = per_sample_gradients(model, inputs, labels, loss_fn=hf.loss_fn, mode=mode, augmentation_multiplicity=K)
            expected = oracle
    except PsgError as err:
        return f"refused {type(err).__name__}: {err}"
    except Exception as err:  # noqa: BLE001 (anything else psg raised is a defect: reported)
        return f"ERROR {type(err).__name__}: {err}"
    try:
        error = compare(grads, expected)
    except RuntimeError as err:  # the check's float64 copies of a huge table: the harness's limit
        return f"skipped: psg returned, the comparison could not run ({str(err)[:120]})"
    if error is None:
        return "WRONG: values that are not finite"
    return "ok" if error < TOLERANCE else f"WRONG: off by {error:.2e} of the largest entry"


def sweep_type(model_type: str, modes: Sequence[str] = ("hooks", "ghost"), *, K: int = 1,
               on_psg: Callable[[], None] | None = None) -> dict[str, str]:
    """One type's line: ``{"type", "oracle"}`` and a result per mode, or ``{"type", "skipped"}``, for
    a batch of :data:`SAMPLES` samples of ``K`` copies each (augmentation multiplicity K);
    ``on_psg`` is called once the model and its oracle are ready, before psg runs."""
    import transformers

    line = {"type": model_type}
    torch.manual_seed(0)
    inputs, labels = hf.batch("bert", SAMPLES * K, steps=8)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            config = transformers.AutoConfig.for_model(model_type, **TINY)
            model = transformers.AutoModelForSequenceClassification.from_config(config).eval()
            with torch.no_grad():
                model(**inputs)
            oracle, line["oracle"] = _oracle(model, inputs, labels, K)
    except Exception as err:  # noqa: BLE001 (a type this configuration does not fit: not psg's)
        return {**line, "skipped": f"{type(err).__name__}: {str(err)[:160]}"}
    if on_psg is not None:
        on_psg()
    for mode in modes:
        line[mode] = _run_mode(model, inputs, labels, oracle, mode, K)
    return line


def _in_its_own_process(model_type: str, timeout: float, memory_gib: float, K: int = 1) -> dict[str, str]:
    command = [sys.executable, "-m", "tests.core.hf_sweep", "--one", model_type, "--memory-gib", str(memory_gib),
               "-K", str(K)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, "PYTHONWARNINGS": "ignore"})
        stdout, why = done.stdout, (f"the process ended with status {done.returncode} "
                                    f"({(done.stderr.strip().splitlines() or [''])[-1][:160]})")
    except subprocess.TimeoutExpired as expired:
        done, why = None, f"over {timeout:.0f} s"
        stdout = expired.stdout.decode() if isinstance(expired.stdout, bytes) else (expired.stdout or "")
    lines = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    if done is not None and done.returncode == 0 and lines and "stage" not in lines[-1]:
        return lines[-1]  # type: ignore[no-any-return]
    if any(line.get("stage") == "psg" for line in lines):  # it died while psg ran: psg's
        return {"type": model_type, "hooks": f"ERROR {why}", "ghost": f"ERROR {why}"}
    return {"type": model_type, "skipped": why}


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the sweep; exit status 1 when a type is WRONG or psg raised an ERROR."""
    parser = argparse.ArgumentParser(prog="python -m tests.core.hf_sweep", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("types", nargs="*", help="model types (default: every sequence classifier)")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a child process: one type, one JSON line
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per type")
    parser.add_argument("--memory-gib", type=float, default=12.0, help="address space per type's process")
    parser.add_argument("-K", type=int, default=1, help="augmentation multiplicity: each sample's copies in the batch")
    options = parser.parse_args(argv)
    torch.set_num_threads(1)
    if options.one:
        import resource

        import transformers

        # One type's defaults can ask for tens of gigabytes (a vocabulary, an expert count): the
        # allocation fails in this process (the type is skipped) before the machine runs out.
        limit = int(options.memory_gib * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

        transformers.logging.set_verbosity_error()
        stage = json.dumps({"type": options.one, "stage": "psg"})
        print(json.dumps(sweep_type(options.one, K=options.K, on_psg=lambda: print(stage, flush=True))), flush=True)
        return 0
    from transformers.models.auto.modeling_auto import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES

    types = options.types or sorted(MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES)
    tally: dict[str, int] = {}
    bad = 0
    for model_type in types:
        line = _in_its_own_process(model_type, options.timeout, options.memory_gib, options.K)
        outcomes = ["skipped"] if "skipped" in line else [line[m].split(" ")[0].rstrip(":") for m in ("hooks", "ghost")]
        for outcome in outcomes:
            tally[outcome] = tally.get(outcome, 0) + 1
        bad += any(o in ("WRONG", "ERROR") for o in outcomes)
        print(json.dumps(line), flush=True)
    print(f"{len(types)} types: " + ", ".join(f"{k} {v}" for k, v in sorted(tally.items()))
          + " (hooks and ghost counted apart; a skipped type once)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
