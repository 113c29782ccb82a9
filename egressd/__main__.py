from egressd.cli import main

main()
