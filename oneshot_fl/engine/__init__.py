"""The data-free distillation machinery, written once and composed by the methods:
losses, BN-statistics hooks, teacher ensembles (mean / stratified aggregation), model
stratification, the synthetic pool, the generator synthesizer and the distillation loop."""
