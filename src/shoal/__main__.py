from shoal.cli import entry

if __name__ == "__main__":  # a forked worker's server imports this module again as __mp_main__
    entry()
