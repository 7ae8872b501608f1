from launcher.deploy.cli import main

raise SystemExit(main())
