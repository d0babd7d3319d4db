from npud.main import main

raise SystemExit(main())
