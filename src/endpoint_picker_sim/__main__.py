from endpoint_picker_sim.cli import main

raise SystemExit(main())
