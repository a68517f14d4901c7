/* Preloaded into TP rank processes (pdserve/gloo_idle.py): gloo's TCP transport runs
 * one loop thread per process ("gloo_tcp_loop") that calls epoll_wait with a fixed 10 ms timeout,
 * so an idle rank wakes 100 times a second for nothing. Data and deferred work wake that thread
 * through its epoll set at once, whatever the timeout; the timeout only paces the "loop ticked"
 * signal that unregistering a socket waits for (at teardown) and the check of its stop flag. This
 * lengthens that one thread's 10 ms timeout to PDSERVE_GLOO_TICK_MS (default 250); every other
 * epoll_wait of the process is passed through unchanged. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>

typedef int (*epoll_wait_fn)(int, struct epoll_event *, int, int);

static epoll_wait_fn real_epoll_wait;
static int tick_ms = -1;

static int gloo_tick_ms(void) {
    if (tick_ms < 0) {
        const char *env = getenv("PDSERVE_GLOO_TICK_MS");
        int value = env ? atoi(env) : 250;
        tick_ms = value >= 10 ? value : 10;
    }
    return tick_ms;
}

int epoll_wait(int epfd, struct epoll_event *events, int maxevents, int timeout) {
    if (real_epoll_wait == NULL)
        real_epoll_wait = (epoll_wait_fn)dlsym(RTLD_NEXT, "epoll_wait");
    if (timeout == 10) {
        char name[16];
        if (pthread_getname_np(pthread_self(), name, sizeof name) == 0 && strcmp(name, "gloo_tcp_loop") == 0)
            timeout = gloo_tick_ms();
    }
    return real_epoll_wait(epfd, events, maxevents, timeout);
}
