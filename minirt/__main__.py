"""`python -m minirt demo | generate` - the command-line entry points (see `minirt.cli`)."""

from minirt.cli import main

raise SystemExit(main())
