"""The process a run lives in: what the launcher started (launcher), who a process is (processes), and SageMaker as one detected environment (sagemaker)."""
