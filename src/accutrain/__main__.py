from accutrain.cli import main

main()
