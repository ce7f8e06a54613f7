from toolchain.cli import main

main()
