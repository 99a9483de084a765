from space.gateway.main import main

main()
