"""`python -m relay train|eval|config ...`: the `relay` command (app/__main__.py) run as a module, with
Relay's package `app` imported even from a folder that holds an `app` of its own (where `python -m app` would
run that one instead)."""

import sys

from relay import _import_app

_import_app()

from app.__main__ import main  # noqa: E402  (Relay's `app`, imported by `_import_app`)

sys.exit(main())
