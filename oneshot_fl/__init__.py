"""oneshot-fl core: data, partitions, models, local training, uploads and the data-free engine.

The bottom layer: it imports nothing from strategies/, launcher/, server_app/ or client_app/
(tests/unit/test_layers.py checks this and that no import cycle exists). One core module imports
Flower, because its job is Flower records: `uploads` (an upload's RecordDict, encoded by a client and
decoded and checked by the server). Everything else here is Flower-free; the Flower apps
(client_app/, server_app/) and the strategies (strategies/) handle Flower messages.
"""

__version__ = "0.1.0"
