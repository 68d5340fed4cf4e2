from fsdpbench.cli import main

main()
