"""``python -m p2pxfer``: the command line."""

from p2pxfer.cli import main

main()
