"""tandem bench (filled in below)."""


def add_arguments(parser):
    pass


def main(args):
    return 0
