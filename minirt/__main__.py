"""`python -m minirt demo | generate | serve | grade | ...` - the command-line entry points (see `minirt.cli`).

Guarded: importing this module (as a submission's `import minirt.__main__` would) runs nothing.
"""

if __name__ == "__main__":
    from minirt.cli import main

    raise SystemExit(main())
