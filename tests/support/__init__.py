"""What the tests share: jobs to run (the example's, Megatron-LM's, ranks as processes, the
pipeline-template trial), network namespaces, the scripts the jobs run, and the repository's
paths. No test module imports another; they import from here."""
