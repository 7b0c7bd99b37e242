"""Tenant limits shared by every replica through Redis (the profile's [cluster] table)."""
