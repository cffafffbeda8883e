from tilefuse.cli import main

raise SystemExit(main())
