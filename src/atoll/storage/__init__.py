"""atoll.storage"""
