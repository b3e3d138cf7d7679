"""The committed stubs in proto/wire/v1 (psg_wire.v1) are exactly what grpcio-tools generates from proto/psg/v1."""

from __future__ import annotations

from pathlib import Path

import psg_wire.v1 as committed_package
from psg_wire.regenerate import default_proto_root, generate


def test_generated_modules_match_the_committed_ones(tmp_path: Path) -> None:
    written = generate(tmp_path)
    committed_dir = Path(committed_package.__file__).parent
    assert {p.name for p in written} == {p.name for p in committed_dir.glob("*_pb2*.py*")}
    drifted = [p.name for p in written if p.read_text() != (committed_dir / p.name).read_text()]
    assert not drifted, (f"{drifted} differ from {default_proto_root()}; run "
                         "`python -m psg_wire.regenerate` and commit the result")


def test_generated_imports_stay_inside_the_package(tmp_path: Path) -> None:
    for path in generate(tmp_path):
        text = path.read_text()
        assert "from psg.v1" not in text and "import psg.v1" not in text, path.name
