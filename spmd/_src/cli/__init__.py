"""The `spmd` command: the argument parser and commands (main), argparse types, the demo's
options (demo_command, no jax) and the demo itself (demo).

Its modules are internal. Importing `spmd._src.cli.main` does not import jax; a command imports
what it needs when it runs.
"""
