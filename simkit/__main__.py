from simkit.cli import main

raise SystemExit(main())
