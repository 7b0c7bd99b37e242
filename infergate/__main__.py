from infergate.cli.main import main

main()
