"""Worker side: engine loop, scheduler, block manager, runner, sampler, models. Installed as mii_async.workers."""
