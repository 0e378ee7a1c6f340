"""The agent tests' job script is run by the agent's zygote, never imported by pytest."""

collect_ignore = ["gloo_job.py"]
