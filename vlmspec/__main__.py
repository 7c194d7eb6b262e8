"""`python -m vlmspec`: the same as the `vlmspec` command."""

from vlmspec.cli import main

raise SystemExit(main())
