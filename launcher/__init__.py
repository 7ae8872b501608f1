"""The run shell: the `oneshot-fl` command line (cli), the simulation launcher (launch, control_api,
shutdown, provenance), replays of an uploads archive (replay), partition previews (preview) and the
deployment tooling (deploy, `oneshot-fl-deploy`).

The top layer, beside server_app/ and client_app/: it builds strategies and uses the core; nothing in
oneshot_fl/ or strategies/ imports it, and the Flower apps do not need it (it is not in the app bundle).
"""
