from endpoint_picker.cli import main

raise SystemExit(main())
