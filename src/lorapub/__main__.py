from lorapub.demo.cli import main

raise SystemExit(main())
