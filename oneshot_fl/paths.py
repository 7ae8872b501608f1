"""The environment variables that name the folders a run reads and writes. A leaf: the dataset loaders name
the data folder's variable in their errors, and config resolves both folders."""

DATA_DIR_ENV = "ONESHOT_FL_DATA_DIR"  # the data folder when data-dir is unset
OUTPUT_DIR_ENV = "ONESHOT_FL_OUTPUT_DIR"  # the output folder when output-dir is unset
