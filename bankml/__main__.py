from bankml.cli import main

raise SystemExit(main())
