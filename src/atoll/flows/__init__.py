"""atoll.flows"""
