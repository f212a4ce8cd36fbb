"""``python -m optladder``: the command line."""

from optladder.cli import main

raise SystemExit(main())
