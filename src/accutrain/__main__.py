from accutrain.cli.main import main

if __name__ == "__main__":  # spawned workers import this module again: they must not start a run
    main()
