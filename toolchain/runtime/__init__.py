"""In-flight batching runtime: requests, the paged KV block manager, the scheduler, the sampler, the step loop."""
