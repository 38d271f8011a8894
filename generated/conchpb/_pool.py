"""The descriptor pool that holds conch's etcd API messages (kept apart from the default pool)."""

from google.protobuf import descriptor_pool

POOL = descriptor_pool.DescriptorPool()
