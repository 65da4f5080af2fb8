"""The rank's restart loop: one iteration of ``train()`` under the monitor, the fault's way back
into the loop, and the teardown and re-creation of the process group (runs in every rank)."""
