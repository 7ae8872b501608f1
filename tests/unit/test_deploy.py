"""Deployment building blocks without processes: fleet description, secrets, CLI connection."""

from __future__ import annotations

import stat
import sys

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.serialization import load_ssh_private_key, load_ssh_public_key
from flwr.common.config import parse_config_args

from launcher.deploy.fleet import Fleet, FleetError, Layout, Node
from launcher.deploy.local import LocalFleet, write_connection
from launcher.deploy.secrets import SecretFiles, generate, server_sans


def test_the_shipped_fleet_description_is_consistent():
    fleet = Fleet.load()
    assert [n.partition_id for n in fleet.nodes] == list(range(fleet.num_partitions))


@pytest.mark.parametrize("nodes, message", [
    ((Node("a", 0, 9094), Node("b", 0, 9095)), "duplicate partition-id"),
    ((Node("a", 0, 9094), Node("b", 3, 9095)), "partition-id 3 outside 0..2"),
    ((Node("a", 0, 9094), Node("b", 1, 9094)), "duplicate port"),
    ((Node("a", 0, 9094), Node("a", 1, 9095)), "duplicate name"),
    ((Node("a", 0, 9094, arch="nope"),), "unknown arch 'nope'"),
    ((Node("a b", 0, 9094),), "letters, digits"),
    ((Node("a", 0, 70000),), "a: port 70000 outside 1..65535"),
])
def test_an_inconsistent_fleet_is_refused_with_the_reason(nodes, message):
    with pytest.raises(FleetError, match=message):
        Fleet(3, nodes).check()


NODE = '[[supernodes]]\nname = "a"\npartition-id = 0\nport = 9094\n'


@pytest.mark.parametrize("text, message", [
    ("[superlink\nport = 1", "is not valid TOML"),
    ("num-partitions = 1\nsupernodes = [1, 2]", "supernodes must be \\[\\[supernodes\\]\\] tables"),
    ('num-partitions = "two"\n' + NODE, "num-partitions = 'two' is not an integer"),
    ("num-partitions = 1\nsuperlink-port = 8000.5\n" + NODE, "superlink-port = 8000.5 is not an integer"),
    ("num-partitions = 1\n" + NODE.replace("port = 9094", 'port = "x"'), "port = 'x' is not an integer"),
    ("num-partitions = 1\n" + NODE.replace("partition-id = 0\n", ""), "lacks \\['partition-id'\\]"),
    (NODE, "num-partitions is missing"),
    ("num-partitions = 1\nsuperlink-port = 0\n" + NODE, "superlink: port 0 outside 1..65535"),
])
def test_a_broken_fleet_file_is_one_fleet_error(tmp_path, text, message):
    path = tmp_path / "fleet.toml"
    path.write_text(text)
    with pytest.raises(FleetError, match=message):
        Fleet.load(path)


def test_node_config_carries_partition_arch_and_role_as_flower_parses_it():
    fleet = Fleet(4, (Node("n", 2, 9094, arch="lenet", role="classifier"),))
    parsed = parse_config_args([fleet.node_config(fleet.nodes[0])])
    assert parsed == {"partition-id": 2, "num-partitions": 4, "arch": "lenet", "role": "classifier"}


def test_auth_without_tls_is_refused():
    with pytest.raises(FleetError, match="needs TLS"):
        Layout(secrets=None, auth=True, isolation="subprocess", bind_host="127.0.0.1",
               superlink_host="127.0.0.1", node_host=lambda n: "127.0.0.1")


def test_secrets_are_valid_private_and_never_silently_replaced(tmp_path):
    files = SecretFiles(tmp_path / "s")
    report = generate(files.root, ["supernode-0", "supernode-1"], superexec=["superlink"])
    assert "ca.crt" in report["created"] and not report["kept"]
    ca = x509.load_pem_x509_certificate(files.ca_cert.read_bytes())
    server = x509.load_pem_x509_certificate(files.server_cert.read_bytes())
    server.verify_directly_issued_by(ca)
    assert {"IP:127.0.0.1", "DNS:localhost", "DNS:superlink"} <= server_sans(files)
    # what flower-supernode --auth-supernode-private-key and flwr supernode register load
    key = load_ssh_private_key(files.node_key("supernode-0").read_bytes(), None)
    assert isinstance(key, ec.EllipticCurvePrivateKey)
    assert load_ssh_public_key(files.node_pub("supernode-0").read_bytes()).public_numbers() == \
        key.public_key().public_numbers()
    for private in (files.ca_key, files.server_key, files.node_key("supernode-1"), files.superexec_secret("superlink")):
        assert stat.S_IMODE(private.stat().st_mode) == 0o600, private

    before = {p.name: p.read_bytes() for p in files.root.iterdir()}
    again = generate(files.root, ["supernode-0", "supernode-1", "supernode-2"],
                     dns=("localhost", "superlink", "linkhost"))
    after = {p.name: p.read_bytes() for p in files.root.iterdir()}
    # a new name re-issues only the SuperLink certificate; the CA and registered keys stay
    assert set(again["created"]) == {"server.pem", "server.key", "supernode-2", "supernode-2.pub"}
    assert all(after[name] == data for name, data in before.items() if not name.startswith("server."))
    assert "DNS:linkhost" in server_sans(files)


def test_cli_connection_is_written_once_and_never_clobbered(tmp_path):
    (tmp_path / "ca.crt").write_text("a CA")
    path = write_connection(tmp_path, "lab", "10.0.0.5:8000", tmp_path / "ca.crt")
    text = path.read_text()
    assert '[superlink.lab]\naddress = "10.0.0.5:8000"' in text and f'root-certificates = "{tmp_path}/ca.crt"' in text
    with pytest.raises(FleetError, match="already has"):
        write_connection(tmp_path, "lab", "10.0.0.6:8000", None)
    write_connection(tmp_path, "other", "127.0.0.1:8000", None)
    assert "insecure = true" in path.read_text() and "10.0.0.5" in path.read_text()


@pytest.mark.parametrize("name, address, ca, message", [
    ("bad name", "10.0.0.5:8000", None, "connection name 'bad name'"),
    ("lab]", "10.0.0.5:8000", None, "connection name"),
    ("lab", "10.0.0.5:99999", None, "port in 1..65535"),
    ("lab", "10.0.0.5:0", None, "port in 1..65535"),
    ("lab", "10.0.0.5", None, "is not HOST:PORT"),
    ("lab", 'evil"\ninsecure = true', None, "is not HOST:PORT"),
    ("lab", "10.0.0.5:8000", "missing-ca.crt", "CA certificate .*missing-ca.crt not found"),
])
def test_a_connection_that_could_not_work_is_refused_and_config_toml_left_as_it_was(tmp_path, name, address, ca,
                                                                                    message):
    config = tmp_path / "config.toml"
    config.write_text('[superlink]\ndefault = "old"\n')
    with pytest.raises(FleetError, match=message):
        write_connection(tmp_path, name, address, tmp_path / ca if ca else None)
    assert config.read_text() == '[superlink]\ndefault = "old"\n'


def test_a_connection_takes_host_names_and_ipv6_addresses(tmp_path):
    write_connection(tmp_path, "a-1", "link.example.org:9093", None)
    text = write_connection(tmp_path, "b_2", "[::1]:9093", None).read_text()
    assert '[superlink.a-1]\naddress = "link.example.org:9093"' in text and 'address = "[::1]:9093"' in text


def test_a_run_that_does_not_fit_the_fleet_is_refused_before_submission(tmp_path):
    fleet = LocalFleet(Fleet.simple(3), tmp_path)
    with pytest.raises(FleetError, match="num-partitions=3"):
        fleet.run({"method": "fedavg", "num-clients": 5})
    assert not fleet.procs  # nothing was started



def test_submitting_to_a_remote_serverapp_leaves_its_paths_alone():
    from launcher.launch import check_run_config, pin_run_config
    from oneshot_fl.run_folder import release_run_folder

    cfg = check_run_config({"method": "fedavg", "run-name": "r1"})
    local, local_dir = pin_run_config(cfg, {"method": "fedavg"}, threads=1)
    release_run_folder(local_dir)  # a folder of this machine is held from here until the run ends
    remote, remote_dir = pin_run_config(cfg, {"method": "fedavg"}, threads=1, paths=False)
    assert "data-dir=" in local and local_dir.is_absolute() and local_dir.name == "r1"
    assert "data-dir=" not in remote and "output-dir=" not in remote and str(remote_dir) == "r1"


def test_a_finished_run_folder_or_a_file_is_refused_before_submission(tmp_path):
    from launcher.launch import check_run_config, pin_run_config
    from oneshot_fl.run_folder import release_run_folder
    from oneshot_fl.errors import RunFolderTaken

    (tmp_path / "done").mkdir()
    (tmp_path / "done" / "result.json").write_text("{}")
    (tmp_path / "a-file").write_text("x")
    (tmp_path / "unfinished").mkdir()
    for name, message in (("done", "already holds a finished run"), ("a-file", "is a file")):
        cfg = check_run_config({"method": "fedavg", "run-name": name, "output-dir": str(tmp_path)})
        with pytest.raises(RunFolderTaken, match=message):
            pin_run_config(cfg, {}, threads=1)
        pin_run_config(cfg, {}, threads=1, paths=False)  # a remote ServerApp's folder is its own business
    cfg = check_run_config({"method": "fedavg", "run-name": "unfinished", "output-dir": str(tmp_path)})
    assert pin_run_config(cfg, {}, threads=1)[1] == tmp_path / "unfinished"  # an empty folder: a new run there
    release_run_folder(tmp_path / "unfinished")


def test_the_deploy_launcher_refuses_a_finished_run_folder_in_one_line_exit_1(tmp_path, capsys):
    from launcher.deploy.cli import main

    (tmp_path / "done").mkdir()
    (tmp_path / "done" / "result.json").write_text("{}")
    code = main(["run", "--insecure", "--work", str(tmp_path / "work"), "-c",
                 f"method='fedavg' run-name='done' output-dir='{tmp_path}'"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1 and "already holds a finished run" in err[0]


def test_an_output_dir_that_cannot_hold_the_run_is_refused_before_submission(tmp_path):
    # the ServerApp would fail on it only after Flower and every client had run
    from oneshot_fl.config import ConfigError
    from launcher.launch import check_run_config, pin_run_config
    from oneshot_fl.run_folder import release_run_folder

    (tmp_path / "a-file").write_text("x")
    cfg = check_run_config({"method": "fedavg", "output-dir": str(tmp_path / "a-file" / "runs")})
    with pytest.raises(ConfigError, match="output-dir=.*a-file/runs' cannot hold the run: Not a directory"):
        pin_run_config(cfg, {}, threads=1)
    pin_run_config(cfg, {}, threads=1, paths=False)  # a remote ServerApp's folder is its own business
    cfg = check_run_config({"method": "fedavg", "output-dir": str(tmp_path / "a-file")})
    with pytest.raises(ConfigError, match="a-file' cannot hold the run: it is a file, not a folder"):
        pin_run_config(cfg, {}, threads=1)
    cfg = check_run_config({"method": "fedavg", "output-dir": str(tmp_path / "new" / "runs")})
    run_dir = pin_run_config(cfg, {}, threads=1)[1]
    assert run_dir.parent == tmp_path / "new" / "runs"
    release_run_folder(run_dir)  # the launch wrote nothing: its folder goes
    assert list((tmp_path / "new" / "runs").iterdir()) == []  # created, the scratch file gone


@pytest.mark.parametrize("argv, message", [
    (["secrets", "--ip", "999.1.1.1"], "'999.1.1.1' is not an IPv4 or IPv6 address"),
    (["secrets", "--dns", "a b"], "'a b' is neither a host name nor an IP address"),
    (["secrets", "--dns", "under_score.example"], "is neither a host name"),
    (["commands", "--superlink-host", "x;rm"], "'x;rm' is neither a host name"),
    (["commands", "--superlink-host", "10.0.0.256"], "'10.0.0.256' is neither a host name"),
])
def test_deploy_refuses_a_bad_host_or_address_before_writing_anything(tmp_path, capsys, argv, message):
    from launcher.deploy.cli import main

    out = tmp_path / "secrets"
    with pytest.raises(SystemExit) as stop:
        main([*argv, *(["--out", str(out)] if argv[0] == "secrets" else [])])
    assert stop.value.code == 2 and message in capsys.readouterr().err
    assert not out.exists()  # the CA used to be written before the bad address failed


def test_deploy_host_types_accept_names_and_addresses():
    from launcher.deploy.cli import host_name, ip_address

    assert host_name("superlink") == "superlink" and host_name("link-1.example.org") == "link-1.example.org"
    assert host_name("10.0.0.5") == "10.0.0.5" and ip_address("::1") == "::1"


def test_submit_to_an_unknown_connection_names_the_known_ones(tmp_path, monkeypatch, capsys):
    from launcher.deploy.cli import known_connection, main

    write_connection(tmp_path, "lab", "10.0.0.5:8000", None)
    known_connection(tmp_path, "lab")
    with pytest.raises(FleetError, match=r"no \[superlink.nothere\] connection in .*config.toml \(known: lab\)"):
        known_connection(tmp_path, "nothere")
    (tmp_path / "config.toml").write_text("[superlink\n")
    with pytest.raises(FleetError, match="is not valid TOML"):
        known_connection(tmp_path, "lab")
    monkeypatch.setenv("FLWR_HOME", str(tmp_path / "empty"))
    assert main(["submit", "--superlink", "nothere", "-c", "preset='smoke'"]) == 2  # before flwr run is called
    assert "no [superlink.nothere] connection" in capsys.readouterr().err and not (tmp_path / "empty").exists()


def test_register_needs_a_known_connection_and_every_key_file_before_registering_any(tmp_path, monkeypatch, capsys):
    import launcher.deploy.cli as deploy_cli
    from launcher.deploy.cli import main

    registered = []
    monkeypatch.setattr(deploy_cli, "register_node", lambda key, *a: registered.append(key) or "7")
    monkeypatch.setenv("FLWR_HOME", str(tmp_path))
    (tmp_path / "a.pub").write_text("ecdsa-sha2-nistp384 AAAA")
    assert main(["register", "lab", str(tmp_path / "a.pub")]) == 2
    assert "no [superlink.lab] connection" in capsys.readouterr().err
    write_connection(tmp_path, "lab", "10.0.0.5:8000", None)
    assert main(["register", "lab", str(tmp_path / "a.pub"), str(tmp_path / "b.pub")]) == 2
    assert f"public key file(s) not found: {tmp_path / 'b.pub'}; nothing registered" in capsys.readouterr().err
    assert registered == []  # a.pub was not registered ahead of the failure
    assert main(["register", "lab", str(tmp_path / "a.pub")]) == 0 and registered == [tmp_path / "a.pub"]


@pytest.mark.parametrize("isolation", ["subprocess", "process"])
def test_commands_for_other_machines_hold_no_path_of_this_machine(tmp_path, capsys, isolation):
    """Each machine's commands name its files relative to the deploy bundle it copies; its heading lists them."""
    from oneshot_fl.config import PROJECT_ROOT
    from launcher.deploy.cli import main

    secrets = tmp_path / "secrets"
    generate(secrets, ["supernode-0", "supernode-1", "supernode-2"],
             superexec=["superlink", "supernode-0", "supernode-1", "supernode-2"], ips=("127.0.0.1", "10.0.0.5"))
    assert main(["commands", "--secrets", str(secrets), "--superlink-host", "10.0.0.5", "--isolation", isolation]) == 0
    text = capsys.readouterr().out
    header, *machines = text.split("\n# == ")
    assert str(secrets) in header and "WARNING" not in text  # the header says where the files come from
    assert len(machines) == 5  # the SuperLink's, three SuperNodes', the submitting machine's
    for section in machines:
        assert str(tmp_path) not in section and str(PROJECT_ROOT) not in section, section
        commands = [line for line in section.splitlines()[1:] if line and not line.startswith("#")]
        assert commands and not [token for line in commands for token in line.split() if token.startswith("/")]
    link = machines[0]
    secret = " superexec-superlink.secret" if isolation == "process" else ""
    assert f"# copy into its deploy bundle: ca.crt server.pem server.key{secret}\n" in link
    assert "--ssl-ca-certfile ca.crt --ssl-certfile server.pem --ssl-keyfile server.key" in link
    node = machines[2]
    assert node.startswith("supernode-1's machine ==")
    secret = " superexec-supernode-1.secret" if isolation == "process" else ""
    assert f"# copy into its deploy bundle: ca.crt supernode-1{secret}\n" in node
    assert "--root-certificates ca.crt --superlink 10.0.0.5:8000 --auth-supernode-private-key supernode-1 " in node
    assert ("--superexec-auth-secret-file superexec-supernode-1.secret" in node) == (isolation == "process")
    assert "register lab supernode-0.pub supernode-1.pub supernode-2.pub" in machines[4]


def test_commands_warn_when_the_secrets_are_not_there_yet(tmp_path, capsys):
    from launcher.deploy.cli import main

    assert main(["commands", "--secrets", str(tmp_path / "none")]) == 0
    assert "# WARNING: not in " in capsys.readouterr().out


@pytest.mark.parametrize("argv0, main_module, shown", [
    ("{root}/launcher/deploy/__main__.py", "launcher.deploy.__main__", "python -m launcher.deploy run"),
    ("/home/u/oneshot-fl/.venv/bin/oneshot-fl-deploy", None, "oneshot-fl-deploy run"),
    ("/home/u/oneshot-fl/.venv/bin/oneshot-fl", None, "oneshot-fl run"),
])
def test_the_run_folder_records_the_launchers_command_as_typed(tmp_path, monkeypatch, argv0, main_module, shown):
    """The command a launcher records in the run folder's lock, which the ServerApp writes into result.json's
    provenance: `python -m launcher.deploy run ...` or the installed command's name, not sys.argv[0]'s path."""
    import importlib.util
    import types

    from launcher.launch import check_run_config, pin_run_config
    from oneshot_fl.config import PROJECT_ROOT
    from oneshot_fl.run_folder import read_holder, release_run_folder

    argv0 = argv0.format(root=PROJECT_ROOT)
    main = types.ModuleType("__main__")  # the __main__ Python makes for `python -m` / for a console script
    main.__file__, main.__spec__ = argv0, importlib.util.find_spec(main_module) if main_module else None
    monkeypatch.setitem(sys.modules, "__main__", main)
    monkeypatch.setattr(sys, "argv", [argv0, "run", "-c", "method='fedavg' run-name='r1'"])
    overrides = {"method": "fedavg", "run-name": "r1", "output-dir": str(tmp_path)}
    _, run_dir = pin_run_config(check_run_config(overrides), overrides, threads=1)
    try:
        assert read_holder(run_dir)["command"] == f"{shown} -c \"method='fedavg' run-name='r1'\""
    finally:
        release_run_folder(run_dir)
