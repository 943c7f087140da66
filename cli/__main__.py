from mlx_dflash.cli.main import main

main()
