"""oneshot-fl core: data, partitions, models, local training, uploads and the data-free engine.

Flower-free on purpose: the apps in client_app/ and server_app/ and the strategies in
strategies/ are the only places that touch Flower messages.
"""

__version__ = "0.1.0"
