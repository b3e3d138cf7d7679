"""``python -m psg_server``: same as the ``psg-server`` console script."""

from __future__ import annotations

from psg_server.cli import main

raise SystemExit(main())
