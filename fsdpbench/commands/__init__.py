"""One module per CLI verb: ``add_arguments(parser)`` and ``main(args) -> int``."""
