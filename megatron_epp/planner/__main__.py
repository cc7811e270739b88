from megatron_epp.planner.cli import main

main()
