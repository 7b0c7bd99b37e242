"""Who may call and how much: tenants, rate and concurrency limits, circuit breakers."""
