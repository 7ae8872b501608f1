from oneshot_fl.deploy.cli import main

raise SystemExit(main())
