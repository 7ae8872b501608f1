"""Deployment: SuperLink/SuperNode processes (local.py), their commands (fleet.py), TLS and
SuperNode-auth material (secrets.py), docker-compose.yml (compose.py). CLI: `python -m launcher.deploy`."""
