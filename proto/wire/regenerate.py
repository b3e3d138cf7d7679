"""Regenerates the committed protobuf/gRPC modules of :mod:`psg_wire.v1` from ``proto/psg/v1``.

``protoc`` names generated imports after the proto path (``from psg.v1 import tensor_pb2``); the
modules live flat in :mod:`psg_wire.v1`, so those imports are rewritten. The descriptor file names
stay ``psg/v1/*.proto``, which is what server reflection shows.

Run ``python -m psg_wire.regenerate`` from a checkout after editing a ``.proto`` file;
``tests/wire/test_proto_drift.py`` regenerates into a temporary folder and fails on any difference.
"""

from __future__ import annotations

import argparse
import logging
import re
import tempfile
from pathlib import Path

__all__ = ["default_proto_root", "generate", "main"]

logger = logging.getLogger(__name__)

_PACKAGE = "psg_wire.v1"
_PROTO_PACKAGE_DIR = Path("psg") / "v1"
_IMPORT = re.compile(r"^from psg\.v1 import ", re.MULTILINE)


def default_proto_root() -> Path:
    """``proto/``, the folder this package sits in (``proto/wire``) beside ``proto/psg/v1``."""
    return Path(__file__).resolve().parents[1]


def generate(out_dir: Path, proto_root: Path | None = None) -> list[Path]:
    """Runs protoc (grpcio-tools) on every ``psg/v1/*.proto`` under ``proto_root``.

    Writes ``<name>_pb2.py``, ``<name>_pb2.pyi`` and ``<name>_pb2_grpc.py`` flat into ``out_dir``
    with imports pointing into :mod:`psg_wire.v1`, and returns the written paths (sorted).

    >>> paths = generate(Path(tempfile.mkdtemp()))  # doctest: +SKIP
    """
    from grpc_tools import protoc  # only needed to regenerate, not to use the stubs

    root = (proto_root or default_proto_root()).resolve()
    protos = sorted((root / _PROTO_PACKAGE_DIR).glob("*.proto"))
    if not protos:
        raise FileNotFoundError(f"generate: no .proto files under {root / _PROTO_PACKAGE_DIR}")
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        args = ["grpc_tools.protoc", f"-I{root}", f"--python_out={tmp}", f"--pyi_out={tmp}",
                f"--grpc_python_out={tmp}"]
        args += [str(p.relative_to(root)) for p in protos]
        status = protoc.main(args)
        if status != 0:
            raise RuntimeError(f"generate: protoc exited with status {status} for {protos}")
        written = []
        for produced in sorted((Path(tmp) / _PROTO_PACKAGE_DIR).iterdir()):
            text = _IMPORT.sub(f"from {_PACKAGE} import ", produced.read_text())
            target = out_dir / produced.name
            target.write_text(text)
            written.append(target)
    logger.info("generate: wrote %d modules into %s", len(written), out_dir)
    return written


def main(argv: list[str] | None = None) -> int:
    """Command line: regenerate into :mod:`psg_wire.v1`'s folder (or ``--out``)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--proto-root", type=Path, default=None, help="folder holding psg/v1/*.proto")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "v1")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    generate(args.out, args.proto_root)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
