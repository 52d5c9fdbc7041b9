"""Many runs at once: the summary and plot of a Hydra sweep (`sweep`, `sweep_plot`), reading run folders into
curves and tables (`analysis`, also used by notebooks/), and the job harness the learning benchmarks run
(`jobs`). None of it takes part in a run."""
