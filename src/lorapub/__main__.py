from lorapub.cli import main

raise SystemExit(main())
