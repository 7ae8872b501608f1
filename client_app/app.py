"""ClientApp: one TRAIN instruction -> local training on this node's shard -> one upload."""

from __future__ import annotations

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from client_app.task import run_client
from oneshot_fl.config import from_run_config
from oneshot_fl.devices import set_threads
from oneshot_fl.logs import setup_logging
from oneshot_fl.uploads import GLOBAL_MODEL_KEY

app = ClientApp()


@app.train()
def train(msg: Message, context: Context) -> Message:
    setup_logging()
    cfg = from_run_config(context.run_config)
    set_threads(cfg.threads)
    instruction = dict(msg.content.config_records["config"]) if "config" in msg.content.config_records else {}
    # multi-round mode, rounds >= 2: the global model to start from
    arrays = msg.content.array_records.get(GLOBAL_MODEL_KEY)
    global_state = arrays.to_torch_state_dict() if arrays is not None else None
    # Exceptions become error replies; the server logs them with this node's id and goes on.
    content = run_client(cfg, dict(context.node_config), instruction, global_state)
    return Message(content=content, reply_to=msg)
